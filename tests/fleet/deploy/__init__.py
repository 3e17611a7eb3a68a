"""Tests of :mod:`agent.fleet.deploy.run`."""
