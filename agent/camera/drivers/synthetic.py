"""A moving test pattern: colour bars, a box that moves one step per frame, and the frame number.

Every frame differs from the one before, so a consumer can tell stale frames from new ones, and
the number drawn in the corner makes dropped frames visible in a snapshot.
"""

from __future__ import annotations

from typing import ClassVar

import cv2
import numpy as np

from agent.camera.drivers.base import Driver, Image
from agent.camera.source_spec import SyntheticSourceSpec

#: SMPTE-like bar colours, BGR.
_BARS = (
    (192, 192, 192),
    (0, 192, 192),
    (192, 192, 0),
    (0, 192, 0),
    (192, 0, 192),
    (0, 0, 192),
    (192, 0, 0),
)


def colour_bars(width: int, height: int) -> Image:
    """Vertical colour bars filling a ``height`` x ``width`` BGR image."""
    image = np.zeros((height, width, 3), dtype=np.uint8)
    edges = np.linspace(0, width, len(_BARS) + 1).astype(int)
    for colour, start, stop in zip(_BARS, edges[:-1], edges[1:], strict=True):
        image[:, start:stop] = colour
    return image


def pattern(background: Image, number: int) -> Image:
    """Frame ``number`` of the pattern drawn over a copy of ``background``."""
    image: Image = np.array(background, dtype=np.uint8, copy=True)
    height, width = image.shape[:2]
    side = max(2, min(width, height) // 5)
    # The box bounces between the edges so its position alone tells neighbouring frames apart.
    span_x, span_y = max(1, width - side), max(1, height - side)
    x = _bounce(number * max(1, side // 4), span_x)
    y = _bounce(number * max(1, side // 8), span_y)
    cv2.rectangle(image, (x, y), (x + side - 1, y + side - 1), (255, 255, 255), thickness=-1)
    scale = max(0.3, height / 480)
    cv2.putText(image, str(number), (2, height - 4), cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), 1)
    return image


def _bounce(position: int, span: int) -> int:
    period = 2 * span
    p = position % period
    return p if p <= span else period - p


class SyntheticDriver(Driver[SyntheticSourceSpec]):
    """Draws the pattern; ends after ``spec.frames`` frames when that is set."""

    kind: ClassVar[str] = "synthetic"

    def __init__(self, spec: SyntheticSourceSpec) -> None:
        super().__init__(spec)
        self._background: Image | None = None
        self._count = 0

    @property
    def pace_fps(self) -> float | None:
        return self.spec.fps or None

    def open(self) -> None:
        self._background = colour_bars(self.spec.width, self.spec.height)
        self.nominal_fps = self.spec.fps or None

    def read(self, timeout_s: float) -> Image | None:
        if self._background is None:
            self.open()
        assert self._background is not None
        if self.spec.frames is not None and self._count >= self.spec.frames:
            return None
        image = pattern(self._background, self._count)
        self._count += 1
        return image

    def close(self) -> None:
        self._background = None
