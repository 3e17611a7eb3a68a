"""Engine builds: what to build for this platform, the engine cache, calibration, the build worker."""
