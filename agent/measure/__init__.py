"""What a built engine is worth on this device: its throughput beside every backend, its INT8 agreement."""
