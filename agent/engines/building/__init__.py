"""One engine build: plan it for this platform, run it in a child process, and hand back a cached artifact."""
