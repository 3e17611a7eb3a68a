"""Tests of :mod:`agent.fleet.chunks.server`."""
