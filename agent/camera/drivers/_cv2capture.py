"""Shared helpers for the drivers that read through ``cv2.VideoCapture``."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import cv2


def capture_fps(capture: Any) -> float | None:
    """The frame rate a capture reports, or None when it reports nothing usable (0, NaN, absurd)."""
    fps = float(capture.get(cv2.CAP_PROP_FPS))
    if not math.isfinite(fps) or fps <= 0 or fps > 1000:
        return None
    return fps


def release(capture: Any) -> None:
    """Release a capture, swallowing errors: closing must never fail."""
    if capture is None:
        return
    with contextlib.suppress(cv2.error):
        capture.release()
