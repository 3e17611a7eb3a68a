"""Tests of :mod:`agent.fleet.devices`."""
