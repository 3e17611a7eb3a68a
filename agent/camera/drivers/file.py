"""Video files decoded by OpenCV, played once or looped, optionally paced at the file's own rate."""

from __future__ import annotations

from typing import Any, ClassVar

import cv2
import structlog

from agent.camera.drivers._cv2capture import (
    capture_fps,
    decode_threads,
    frame_size,
    read_frame,
    release,
    thread_params,
)
from agent.camera.drivers.base import Driver, Image, as_bgr
from agent.camera.source_spec import FileSourceSpec
from agent.errors import SourceError

log = structlog.get_logger(__name__)

#: Pace used in realtime mode when the container does not state a frame rate.
FALLBACK_FPS = 25.0


class FileDriver(Driver[FileSourceSpec]):
    """Reads ``spec.path``; at the end it seeks back to the start (``loop``) or ends the stream."""

    kind: ClassVar[str] = "file"
    is_live: ClassVar[bool] = False

    def __init__(self, spec: FileSourceSpec) -> None:
        super().__init__(spec)
        self._capture: Any = None
        self._frames_since_open = 0
        #: FFmpeg decoder threads of the open file (0: FFmpeg's default).
        self.decode_threads = 0

    @property
    def pace_fps(self) -> float | None:
        if not self.spec.realtime:
            return None
        return self.nominal_fps or FALLBACK_FPS

    def open(self) -> None:
        path = self.spec.path
        if not path.is_file():
            raise SourceError(f"video file {path} does not exist or is not a file: check source.path")
        self.close()
        # Opened on one decoder thread first (cheap); a frame too big for one thread reopens with more.
        capture = self._open_capture(self.spec.decode_threads or 1)
        threads = decode_threads(self.spec.decode_threads, *frame_size(capture))
        if threads != (self.spec.decode_threads or 1):
            release(capture)
            capture = self._open_capture(threads)
        self._capture = capture
        self.decode_threads = threads
        self._frames_since_open = 0
        self.nominal_fps = capture_fps(capture)
        if self.spec.realtime and self.nominal_fps is None:
            log.warning("camera.file.no_fps", path=str(path), pace_fps=FALLBACK_FPS)

    def _open_capture(self, threads: int) -> Any:
        path = self.spec.path
        capture = cv2.VideoCapture(str(path), cv2.CAP_ANY, thread_params(threads))
        if not capture.isOpened():
            release(capture)
            raise SourceError(f"OpenCV cannot decode video file {path}: is it a video in a supported codec?")
        return capture

    def read(self, timeout_s: float) -> Image | None:
        # A local file never blocks for long, so the timeout is not needed here.
        if self._capture is None:
            raise SourceError("file source read before open")
        ok, image = read_frame(self._capture, self.buffers)
        if not ok:
            if self._frames_since_open == 0:
                raise SourceError(f"video file {self.spec.path} has no decodable frames")
            if not self.spec.loop:
                return None
            ok, image = self._rewind()
        self._frames_since_open += 1
        return as_bgr(image)

    def _rewind(self) -> tuple[bool, Any]:
        """Start the file again: seek to frame 0, or reopen where the container cannot seek."""
        if self._capture.set(cv2.CAP_PROP_POS_FRAMES, 0):
            ok, image = read_frame(self._capture, self.buffers)
            if ok:
                return ok, image
        self.open()
        ok, image = read_frame(self._capture, self.buffers)
        if not ok:
            raise SourceError(f"video file {self.spec.path} could not be restarted for looping")
        return ok, image

    def close(self) -> None:
        release(self._capture)
        self._capture = None
