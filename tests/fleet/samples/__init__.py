"""Tests of :mod:`agent.fleet.samples`."""
