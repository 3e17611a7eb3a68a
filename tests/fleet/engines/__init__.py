"""Tests of :mod:`agent.fleet.engines`."""
