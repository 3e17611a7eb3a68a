"""The engine cache on disk: one entry per cache key, and the key that says what an engine was built from."""
