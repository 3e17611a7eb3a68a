"""Camera sources, frame transforms and the frame type."""
