"""Tests of :mod:`agent.fleet.view.live`."""
