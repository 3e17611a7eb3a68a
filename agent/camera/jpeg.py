"""A frame as a JPEG within a longest side and a byte budget: snapshots, samples and evidence send them.

Quality is lowered first, then the size, until the JPEG fits: one message, never chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from agent.errors import AgentError

#: Qualities tried after the configured one, in order, before the image is made smaller.
_FALLBACK_QUALITIES = (70, 50, 30, 15)
#: Below this longest side a smaller image would say nothing: the budget is too small.
_MIN_SIDE = 16


class SnapshotTooLargeError(AgentError):
    """Even the smallest, lowest-quality JPEG does not fit the byte budget."""

    code = "snapshot_too_large"


@dataclass(frozen=True)
class Jpeg:
    """An encoded frame: its bytes, size and the quality it took to fit."""

    data: bytes
    width: int
    height: int
    quality: int


def encode_jpeg(image: npt.NDArray[np.uint8], max_dimension: int, max_bytes: int, quality: int) -> Jpeg:
    """``image`` (BGR) as a JPEG of at most ``max_dimension`` a side and ``max_bytes`` bytes.

    Scaled down (area interpolation) to ``max_dimension`` first; then quality steps down from
    ``quality``, then the size halves, until it fits. Raises SnapshotTooLargeError when even a
    ``_MIN_SIDE`` pixel image at the lowest quality does not.
    """
    height, width = image.shape[:2]
    qualities = [quality, *(q for q in _FALLBACK_QUALITIES if q < quality)]
    scale = min(1.0, max_dimension / max(height, width))
    small: npt.NDArray[Any] = image
    smallest = 0
    while True:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        if size != (small.shape[1], small.shape[0]):
            small = cv2.resize(small, size, interpolation=cv2.INTER_AREA)
        for q in qualities:
            ok, buffer = cv2.imencode(".jpg", small, [cv2.IMWRITE_JPEG_QUALITY, q])
            if not ok:
                raise SnapshotTooLargeError("the frame could not be encoded as JPEG")
            smallest = len(buffer)
            if len(buffer) <= max_bytes:
                return Jpeg(buffer.tobytes(), size[0], size[1], q)
        if max(size) <= _MIN_SIDE:
            raise SnapshotTooLargeError(
                f"a {size[0]}x{size[1]} JPEG at quality {qualities[-1]} takes {smallest} bytes, over the "
                f"budget of {max_bytes}: raise snapshot.max_bytes (or mqtt.max_payload_bytes)"
            )
        scale = max(_MIN_SIDE / max(height, width), scale / 2)
