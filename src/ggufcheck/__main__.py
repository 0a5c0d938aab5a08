"""Allows ``python -m ggufcheck``."""

from ggufcheck.cli import main

raise SystemExit(main())
