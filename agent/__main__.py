"""``python -m agent`` is ``edge-agent``."""

from agent.cli import main

raise SystemExit(main())
