"""Network cameras (RTSP, HTTP MJPEG) read through OpenCV's FFmpeg backend.

The opencv-python-headless wheel's FFmpeg reads ``multipart/x-mixed-replace`` HTTP MJPEG streams
as well as RTSP, so one driver serves both (tests/camera/test_source_url.py, test_source_rtsp.py).
OpenCV asks FFmpeg for RTP over TCP first (``rtsp_flags=prefer_tcp``) and takes UDP only from a
camera that offers nothing else.

Frames missing from the stream (lost packets took a whole frame) show as a jump in the frame
timestamps and are counted in the driver's ``frames_missing``. A frame FFmpeg decoded with
concealed errors cannot be told from a clean one through OpenCV, which does not pass on FFmpeg's
per-frame corruption flag.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit, urlunsplit

import cv2

from agent.camera.drivers._cv2capture import capture_fps, read_frame, release, thread_params
from agent.camera.drivers.base import Driver, Image, as_bgr, missing_frames
from agent.camera.drivers.rtsp_answer import describe_status
from agent.camera.source_spec import UrlSourceSpec
from agent.errors import ConfigError, CredentialsRejectedError, SourceError
from agent.secret_file import read_secret

#: Longest wait for the camera's answer to our own DESCRIBE after a failed open.
ASK_TIMEOUT_S = 3.0

_CREDENTIALS = re.compile(r"//[^/@]*@")


def redact(url: str) -> str:
    """The URL without ``user:password@``, for logs and error messages."""
    return _CREDENTIALS.sub("//***@", url)


def with_password(url: str, password_file: Path | None) -> str:
    """``url`` with the password in ``password_file`` after its user (read at every open: a new
    password delivered as a file is used at the next reconnect)."""
    if password_file is None:
        return url
    try:
        password = read_secret(password_file)
    except ConfigError as exc:
        raise SourceError(str(exc)) from exc
    parts = urlsplit(url)
    if parts.username is None or parts.hostname is None:
        raise SourceError(
            f"camera URL {redact(url)} names no user for its password_file (rtsp://user@host/...)"
        )
    host = parts.netloc.rsplit("@", 1)[1]
    netloc = f"{quote(parts.username, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


class UrlDriver(Driver[UrlSourceSpec]):
    """Opens ``spec.url`` with ``cv2.CAP_FFMPEG`` and explicit open/read timeouts."""

    kind: ClassVar[str] = "url"

    def __init__(self, spec: UrlSourceSpec) -> None:
        super().__init__(spec)
        self._capture: Any = None
        self._last_pts_ms: float | None = None
        self._frames_since_open = 0

    def open(self) -> None:
        url = with_password(self.spec.url, self.spec.password_file)
        if not url.startswith(("rtsp://", "rtsps://", "http://", "https://")):
            raise SourceError(f"camera URL {redact(url)} must start with rtsp://, http:// or https://")
        self.close()
        params = [
            cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
            int(self.spec.open_timeout_s * 1000),
            cv2.CAP_PROP_READ_TIMEOUT_MSEC,
            int(self.spec.read_timeout_s * 1000),
            *thread_params(self.spec.decode_threads),
        ]
        capture = cv2.VideoCapture(url, cv2.CAP_FFMPEG, params)
        if not capture.isOpened():
            release(capture)
            raise open_failure(url, self.spec.open_timeout_s)
        self._capture = capture
        self._last_pts_ms = None
        self._frames_since_open = 0
        self.nominal_fps = capture_fps(capture)

    def read(self, timeout_s: float) -> Image | None:
        # Bounded by spec.read_timeout_s, given to FFmpeg at open (it cannot be changed afterwards).
        if self._capture is None:
            raise SourceError("url source read before open")
        ok, image = read_frame(self._capture, self.buffers)
        if not ok or image is None:
            shown, wait_s = redact(self.spec.url), self.spec.read_timeout_s
            if self._frames_since_open == 0:
                raise SourceError(
                    f"camera {shown} answered but sent no frame after opening (the stream ended or "
                    f"stayed silent for {wait_s:g} s, read_timeout_s): check that it is streaming, "
                    "and its codec (H.264/H.265/MJPEG)"
                )
            raise SourceError(
                f"camera stream {shown} ended or sent no frame for {wait_s:g} s (read_timeout_s)"
            )
        self._frames_since_open += 1
        self._count_missing(float(self._capture.get(cv2.CAP_PROP_POS_MSEC)))
        return as_bgr(image)

    def _count_missing(self, pts_ms: float) -> None:
        """Add the frames a jump in the timestamps skipped; the first frames of a stream may repeat 0."""
        fps, last = self.nominal_fps, self._last_pts_ms
        self._last_pts_ms = pts_ms
        if fps is None or last is None or pts_ms <= last:
            return
        self.frames_missing += missing_frames((pts_ms - last) / 1000.0, fps)

    def close(self) -> None:
        release(self._capture)
        self._capture = None


def open_failure(url: str, open_timeout_s: float) -> SourceError:
    """The error for a camera that did not open, with what the camera itself answers when asked."""
    shown = redact(url)
    status = describe_status(url, ASK_TIMEOUT_S) if url.startswith("rtsp://") else None
    has_credentials = _CREDENTIALS.search(url) is not None
    if status == 401 and has_credentials:
        return CredentialsRejectedError(
            f"camera {shown} refused the credentials (401 Unauthorized): check the URL's user and password"
        )
    if status == 401:
        return CredentialsRejectedError(
            f"camera {shown} asks for credentials (401 Unauthorized): put user:password@ in the URL"
        )
    if status == 404:
        return SourceError(f"camera {shown} has no stream at this path (404 Not Found): check the URL's path")
    if status == 200:
        return SourceError(
            f"camera {shown} answers but sent no playable stream within {open_timeout_s:g} s "
            "(open_timeout_s): check that it is streaming, and its codec (H.264/H.265/MJPEG)"
        )
    if status is not None:
        return SourceError(f"camera {shown} answered RTSP status {status} to DESCRIBE")
    return SourceError(
        f"cannot open camera stream {shown}: check that the camera is reachable and the "
        "URL, path and credentials are right"
    )
