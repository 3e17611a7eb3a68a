"""Tests of :mod:`agent.fleet.metrics.exposition`."""
