"""The small interface every camera driver implements.

A driver knows one kind of source (a file, a V4L2 device, a URL, a GStreamer pipeline, a test
pattern) and nothing about retries, states or frame numbering: :class:`agent.camera.source.VideoSource`
owns those. The contract:

- :meth:`Driver.open` raises :class:`agent.errors.SourceError` with a reason an operator can act on.
- :meth:`Driver.read` returns one BGR image, returns ``None`` when the stream has *ended* for good
  (a file played once, a synthetic source with a frame limit), and raises ``SourceError`` on any
  failure the source should recover from by reopening (camera gone, timeout, process exit).
- :meth:`Driver.close` is idempotent and never raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import cv2
import numpy as np
import numpy.typing as npt

from agent.camera.frame_pool import FramePool
from agent.errors import SourceError

Image = npt.NDArray[np.uint8]

SpecT = TypeVar("SpecT")

#: Floor of every blocking read: a camera may pause briefly (auto exposure, a keyframe) without
#: that being a failure.
MIN_READ_TIMEOUT_S = 2.0


def read_timeout_s(nominal_fps: float | None) -> float:
    """How long one read may block: two frame intervals, at least :data:`MIN_READ_TIMEOUT_S`."""
    if nominal_fps is None or nominal_fps <= 0:
        return MIN_READ_TIMEOUT_S
    return max(MIN_READ_TIMEOUT_S, 2.0 / nominal_fps)


def missing_frames(step_s: float, fps: float) -> int:
    """Frames missing between two frames ``step_s`` apart in a stream of ``fps`` (pure).

    A step up to 1.5 frame intervals is the next frame: cameras' clocks jitter.
    """
    if fps <= 0 or step_s <= 1.5 / fps:
        return 0
    return max(0, round(step_s * fps) - 1)


def as_bgr(image: npt.NDArray[np.uint8]) -> Image:
    """Return ``image`` as a contiguous H x W x 3 uint8 BGR array (gray and BGRA are converted)."""
    if image.dtype != np.uint8:
        raise SourceError(f"camera delivered {image.dtype} pixels; only 8-bit images are supported")
    if image.ndim == 2:
        converted = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    elif image.ndim == 3 and image.shape[2] == 4:
        converted = cv2.cvtColor(image, cv2.COLOR_BGRA2BGR)
    elif image.ndim == 3 and image.shape[2] == 3:
        converted = image
    else:
        raise SourceError(f"camera delivered an image of shape {image.shape}; expected H x W x 3")
    return np.ascontiguousarray(converted, dtype=np.uint8)


class Driver(ABC, Generic[SpecT]):
    """One kind of camera behind open/read/close; see the module docstring for the contract."""

    #: Registry key, equal to the ``type`` of the spec this driver reads.
    kind: ClassVar[str] = ""
    #: False only for sources whose every frame must be processed (files).
    is_live: ClassVar[bool] = True

    def __init__(self, spec: SpecT) -> None:
        self.spec = spec
        #: The source's own frame rate, known after :meth:`open` (None when it does not say).
        self.nominal_fps: float | None = None
        #: The camera's own frame size when the driver delivers frames scaled from it (None: as is).
        self.native_size: tuple[int, int] | None = None
        #: Buffers the driver decodes into again once no stage holds them (:mod:`agent.camera.frame_pool`).
        self.buffers = FramePool()
        #: Frames the source sent that never arrived while open (a jump in its frame timestamps), for
        #: drivers that can tell; over the driver's life, across reopens.
        self.frames_missing = 0

    @property
    def pace_fps(self) -> float | None:
        """Rate at which the caller should pace reads, or None to read as fast as frames come.

        Live cameras pace themselves; a file in realtime mode and the synthetic pattern do not.
        """
        return None

    @abstractmethod
    def open(self) -> None:
        """Open the source; raise :class:`SourceError` saying why it cannot be opened."""

    @abstractmethod
    def read(self, timeout_s: float) -> Image | None:
        """Return the next image, ``None`` at the end of the stream, or raise :class:`SourceError`."""

    @abstractmethod
    def close(self) -> None:
        """Release the source. Idempotent; never raises."""
