"""The agent's log lines: how they are written, and the latest ones kept for the ``logs`` command."""
