"""Tests of :mod:`agent.fleet.base`."""
