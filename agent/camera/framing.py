"""A stream's framing: its frames turned (90, 180, 270 degrees clockwise), then cut to a region of
interest, before preprocessing, snapshots and everything else see them.

Pure functions. The region is given in the turned frame's coordinates (as the operator sees the
picture upright), but the cut is made first, on the camera's own frame, where it is a view that
copies nothing; only the region's pixels are then turned (``cv2.rotate``) or copied into one
contiguous array. So a quarter of a 1080p frame costs a quarter of a full frame's turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from agent.camera.source_spec import Region

Image = npt.NDArray[np.uint8]

_ROTATE = {90: cv2.ROTATE_90_CLOCKWISE, 180: cv2.ROTATE_180, 270: cv2.ROTATE_90_COUNTERCLOCKWISE}


@dataclass(frozen=True)
class Framing:
    """What a stream does to each frame: ``rotate`` degrees clockwise, then keep ``roi`` (None: all)."""

    rotate: int = 0
    roi: Region | None = None

    @property
    def is_identity(self) -> bool:
        """True when frames pass untouched (the frame path then skips the call)."""
        return self.rotate == 0 and self.roi is None


def region_pixels(roi: Region | None, width: int, height: int) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` of ``roi`` in a ``width`` x ``height`` frame, at least one pixel."""
    if roi is None:
        return 0, 0, width, height
    left = min(width - 1, round(roi.x * width))
    top = min(height - 1, round(roi.y * height))
    right = max(left + 1, min(width, round((roi.x + roi.width) * width)))
    bottom = max(top + 1, min(height, round((roi.y + roi.height) * height)))
    return left, top, right, bottom


def source_rectangle(framing: Framing, width: int, height: int) -> tuple[int, int, int, int]:
    """The rectangle of the camera's ``width`` x ``height`` frame that becomes the framed image:
    ``(left, top, right, bottom)`` in the camera's pixels (the region mapped back through the turn)."""
    turned_w, turned_h = (height, width) if framing.rotate in (90, 270) else (width, height)
    x0, y0, x1, y1 = region_pixels(framing.roi, turned_w, turned_h)
    if framing.rotate == 90:  # turned[r, c] = frame[height - 1 - c, r]
        return y0, height - x1, y1, height - x0
    if framing.rotate == 180:  # turned[r, c] = frame[height - 1 - r, width - 1 - c]
        return width - x1, height - y1, width - x0, height - y0
    if framing.rotate == 270:  # turned[r, c] = frame[c, width - 1 - r]
        return width - y1, x0, width - y0, x1
    return x0, y0, x1, y1


def framed(image: Image, framing: Framing) -> Image:
    """``image`` turned and cut as ``framing`` says: a new contiguous array (``image`` itself when
    the framing is the identity)."""
    if framing.is_identity:
        return image
    height, width = image.shape[:2]
    left, top, right, bottom = source_rectangle(framing, width, height)
    part = image[top:bottom, left:right]
    if framing.rotate:
        return np.ascontiguousarray(cv2.rotate(part, _ROTATE[framing.rotate]))
    return np.ascontiguousarray(part)
