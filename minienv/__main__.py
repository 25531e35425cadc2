"""``python -m minienv "prompt"``: see :mod:`minienv.cli`."""

from minienv.cli import main

raise SystemExit(main())
