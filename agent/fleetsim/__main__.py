"""``python -m agent.fleetsim``: the fleet simulator (see :mod:`agent.fleetsim.launcher`)."""

from agent.fleetsim.launcher import main

raise SystemExit(main())
