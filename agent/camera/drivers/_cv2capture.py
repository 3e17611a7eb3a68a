"""Shared helpers for the drivers that read through ``cv2.VideoCapture``."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import cv2

from agent.camera.frame_pool import FramePool


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


#: With ``decode_threads: 0`` (auto), frames up to this many pixels are decoded on one FFmpeg thread.
#: FFmpeg's own default (a thread per core) cost ~20 % more CPU per 640x480 MJPEG frame here
#: (bench/pipeline.py), CPU the agent's other stages run on; bigger frames (4K H.264) need the
#: threads to keep up with their frame rate.
SINGLE_THREAD_MAX_PIXELS = 1920 * 1080


def decode_threads(requested: int, width: int, height: int) -> int:
    """FFmpeg decoder threads for a stream of ``width`` x ``height``; 0 leaves FFmpeg's default (pure)."""
    if requested > 0:
        return requested
    return 1 if 0 < width * height <= SINGLE_THREAD_MAX_PIXELS else 0


def thread_params(threads: int) -> list[int]:
    """``cv2.VideoCapture`` open parameters that set the decoder's thread count (none for 0)."""
    return [cv2.CAP_PROP_N_THREADS, threads] if threads > 0 else []


def frame_size(capture: Any) -> tuple[int, int]:
    """Width and height a capture reports (0 when unknown)."""
    return int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))


def read_frame(capture: Any, pool: FramePool) -> tuple[bool, Any]:
    """``capture.read()`` into a free buffer of ``pool`` when it has one (OpenCV writes a frame of the
    buffer's size in place and returns that array; another size, a new array), else into a new array."""
    taken = pool.take()
    ok, image = capture.read() if taken is None else capture.read(taken)
    if ok and image is not None:
        pool.keep(image, taken)
    return ok, image
