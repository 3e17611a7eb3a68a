"""Procedurally generated datasets: real images to train, calibrate and check models on, without downloads."""
