"""Serving model chunks to the devices that pull them."""
