"""Tests of :mod:`agent.fleet.console`."""
