"""Placement by measurement: which devices a slot builds engines for, and which timed combination it keeps."""
