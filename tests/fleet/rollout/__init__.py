"""Tests of :mod:`agent.fleet.rollout`."""
