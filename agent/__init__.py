"""Edge inference agent for NVIDIA Jetson fleets."""

__version__ = "0.1.0"
