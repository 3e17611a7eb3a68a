"""Network cameras (RTSP, HTTP MJPEG) read through OpenCV's FFmpeg backend.

The opencv-python-headless wheel's FFmpeg reads ``multipart/x-mixed-replace`` HTTP MJPEG streams
as well as RTSP, so one driver serves both (verified by tests/camera/test_source_url.py).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import cv2

from agent.camera.drivers._cv2capture import capture_fps, read_frame, release, thread_params
from agent.camera.drivers.base import Driver, Image, as_bgr
from agent.camera.source_spec import UrlSourceSpec
from agent.errors import SourceError

#: Longest wait for the connection and the stream header.
OPEN_TIMEOUT_S = 10.0
#: Longest wait for one frame. FFmpeg takes its timeouts only when the capture is opened, before
#: the stream's rate is known, so this is fixed: 5 s covers cameras down to 0.4 fps.
READ_TIMEOUT_S = 5.0

_CREDENTIALS = re.compile(r"//[^/@]*@")


def redact(url: str) -> str:
    """The URL without ``user:password@``, for logs and error messages."""
    return _CREDENTIALS.sub("//***@", url)


class UrlDriver(Driver[UrlSourceSpec]):
    """Opens ``spec.url`` with ``cv2.CAP_FFMPEG`` and explicit open/read timeouts."""

    kind: ClassVar[str] = "url"

    def __init__(self, spec: UrlSourceSpec) -> None:
        super().__init__(spec)
        self._capture: Any = None

    def open(self) -> None:
        url = self.spec.url
        if not url.startswith(("rtsp://", "rtsps://", "http://", "https://")):
            raise SourceError(f"camera URL {redact(url)} must start with rtsp://, http:// or https://")
        self.close()
        params = [
            cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
            int(OPEN_TIMEOUT_S * 1000),
            cv2.CAP_PROP_READ_TIMEOUT_MSEC,
            int(READ_TIMEOUT_S * 1000),
            *thread_params(self.spec.decode_threads),
        ]
        capture = cv2.VideoCapture(url, cv2.CAP_FFMPEG, params)
        if not capture.isOpened():
            release(capture)
            raise SourceError(
                f"cannot open camera stream {redact(url)}: check that the camera is reachable and the "
                "URL, path and credentials are right"
            )
        self._capture = capture
        self.nominal_fps = capture_fps(capture)

    def read(self, timeout_s: float) -> Image | None:
        # Bounded by READ_TIMEOUT_S, given to FFmpeg at open (it cannot be changed afterwards).
        if self._capture is None:
            raise SourceError("url source read before open")
        ok, image = read_frame(self._capture, self.buffers)
        if not ok or image is None:
            raise SourceError(f"camera stream {redact(self.spec.url)} ended or timed out")
        return as_bgr(image)

    def close(self) -> None:
        release(self._capture)
        self._capture = None
