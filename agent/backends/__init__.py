"""Inference backends behind one small interface; see :mod:`agent.backends.base`."""
