"""Engine integrations: thin adapters that turn an engine's forward into producer calls."""
