"""Offline bundles: what the controller would send some devices, in one signed file."""
