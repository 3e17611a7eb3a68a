"""Tests of :mod:`agent.fleet.cli.main`."""
