"""Camera sources, frame transforms (on the CPU, on the GPU, to JPEG) and the frame type."""
