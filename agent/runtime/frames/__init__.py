"""The frame path: capture, preprocess, infer, postprocess, publish, and its taps (snapshots, samples)."""
