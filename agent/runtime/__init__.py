"""Model slots, hot-swap and the frame pipeline."""
