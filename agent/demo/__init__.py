"""Trying the agent on one machine: ``edge-agent demo`` and the broker, models and video it runs on."""
