"""The INT8 accuracy guard: an INT8 engine goes live only if it agrees with the FP32 model."""
