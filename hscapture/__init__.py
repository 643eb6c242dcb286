"""hscapture: per-layer hidden states out of a live LLM engine at almost no cost to serving.

The names below load on first use, so that importing one part (a reader, say) does not import
the others (the producer's sockets and wire codec).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "CaptureConfig": "hscapture.config",
    "ConsumerConfig": "hscapture.config",
    "CreditTimeout": "hscapture.errors",
    "HSCaptureError": "hscapture.errors",
    "ProtocolError": "hscapture.errors",
    "StoreError": "hscapture.errors",
    "NullProducer": "hscapture.producer",
    "Producer": "hscapture.producer",
    "ProducerCounters": "hscapture.producer",
    "Store": "hscapture.store.reader",
    "StoreSet": "hscapture.store.collection",
    "open_store": "hscapture.store.collection",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hscapture' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
