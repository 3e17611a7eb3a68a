"""Tests of :mod:`agent.fleet.controller.process`."""
