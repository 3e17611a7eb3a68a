"""Offline bundles on the device: a bundle checked and its desired states handed to the agent."""
