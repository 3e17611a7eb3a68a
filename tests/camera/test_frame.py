"""A frame with another image keeps everything else."""

from __future__ import annotations

import dataclasses

import numpy as np

from agent.camera.frame import Frame


def test_with_image_keeps_every_other_field() -> None:
    frame = Frame("cam", 7, np.ones((2, 2, 3), np.uint8), 1.5, 2.5, {"k": 1}, (1920, 1080))
    empty = np.zeros((0, 0, 3), np.uint8)
    other = frame.with_image(empty)
    assert other.image is empty
    # Every other field, as dataclasses.replace keeps it: a field added to Frame and not copied fails.
    assert [getattr(other, f.name) for f in dataclasses.fields(Frame) if f.name != "image"] == [
        getattr(frame, f.name) for f in dataclasses.fields(Frame) if f.name != "image"
    ]
