"""INT8 calibration: frames in, ranges and TensorRT calibration caches out, kept on disk for reuse."""
