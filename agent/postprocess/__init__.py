"""Turn raw model outputs into classes, detections or tensors."""
