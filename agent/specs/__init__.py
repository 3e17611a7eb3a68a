"""The model specs a slot's config and a signed manifest share: build, preprocess, postprocess."""
