"""The device's model slots and the frame path that runs them, in two rooms: ``frames`` and ``slots``."""
