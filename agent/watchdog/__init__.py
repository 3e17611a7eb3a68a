"""Telling systemd the agent is up and still working, and which blocking call a stuck thread is in."""
