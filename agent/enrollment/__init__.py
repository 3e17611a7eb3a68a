"""The device's own certificate: asked for with a claim (enrollment) and renewed before it expires."""
