"""The unit of work of the frame path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class Frame:
    """One captured image of a stream.

    ``index`` counts frames of the stream from 0 without gaps; a file source that loops keeps
    counting. ``captured_at`` is wall-clock (for consumers), ``captured_mono`` monotonic (for latency).
    """

    stream: str
    index: int
    image: npt.NDArray[np.uint8]  # H x W x 3, BGR, as OpenCV decodes
    captured_at: float
    captured_mono: float
    meta: dict[str, Any] | None = None
    #: The camera's own ``(width, height)`` when the source scaled the image before the agent got it
    #: (a GStreamer pipeline scaling on the VIC); boxes are mapped back to it. None: not scaled.
    native_size: tuple[int, int] | None = None

    def with_image(self, image: npt.NDArray[np.uint8]) -> Frame:
        """This frame with ``image`` instead of its own (the frame path lets go of the pixels once
        inferred). Built field by field: ``dataclasses.replace`` costs twice as much per frame."""
        return Frame(
            self.stream, self.index, image, self.captured_at, self.captured_mono, self.meta, self.native_size
        )
