from hscapture.cli import main

raise SystemExit(main())
