"""V4L2 devices (USB cameras) read through OpenCV's V4L2 backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import cv2
import structlog

from agent.camera.drivers._cv2capture import capture_fps, read_frame, release
from agent.camera.drivers.base import MIN_READ_TIMEOUT_S, Driver, Image, as_bgr
from agent.camera.source_spec import V4L2SourceSpec
from agent.errors import SourceError

log = structlog.get_logger(__name__)

# OpenCV's V4L2 backend ignores CAP_PROP_READ_TIMEOUT_MSEC; a stalled camera blocks each read in
# select() for OPENCV_VIDEOIO_V4L_SELECT_TIMEOUT seconds (10 by default), read once on first use.
# Shorten it so a hung camera becomes a reconnect quickly; an operator's own setting wins.
os.environ.setdefault("OPENCV_VIDEOIO_V4L_SELECT_TIMEOUT", str(int(MIN_READ_TIMEOUT_S)))


class V4L2Driver(Driver[V4L2SourceSpec]):
    """Opens ``spec.device`` with ``cv2.CAP_V4L2`` and requests the configured size and rate."""

    kind: ClassVar[str] = "v4l2"

    def __init__(self, spec: V4L2SourceSpec) -> None:
        super().__init__(spec)
        self._capture: Any = None

    def open(self) -> None:
        device = self.spec.device
        if not Path(device).exists():
            raise SourceError(
                f"camera device {device} does not exist: is the camera plugged in? "
                "(`ls /dev/video*` lists the devices; check source.device)"
            )
        if not os.access(device, os.R_OK | os.W_OK):
            raise SourceError(
                f"no permission to open camera device {device}: add the agent's user to the 'video' group"
            )
        self.close()
        capture = cv2.VideoCapture(device, cv2.CAP_V4L2)
        if not capture.isOpened():
            release(capture)
            raise SourceError(
                f"OpenCV could not open {device} as a V4L2 capture device: is it a capture node "
                "(`v4l2-ctl --list-devices`) and not used by another process?"
            )
        # Requests, not guarantees: the driver picks the nearest mode it supports.
        if self.spec.width is not None:
            capture.set(cv2.CAP_PROP_FRAME_WIDTH, self.spec.width)
        if self.spec.height is not None:
            capture.set(cv2.CAP_PROP_FRAME_HEIGHT, self.spec.height)
        if self.spec.fps is not None:
            capture.set(cv2.CAP_PROP_FPS, self.spec.fps)
        self._capture = capture
        self.nominal_fps = capture_fps(capture)
        log.info(
            "camera.v4l2.opened",
            device=device,
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=self.nominal_fps,
        )

    def read(self, timeout_s: float) -> Image | None:
        # The wait is bounded by OPENCV_VIDEOIO_V4L_SELECT_TIMEOUT (set above), not by timeout_s.
        if self._capture is None:
            raise SourceError("v4l2 source read before open")
        ok, image = read_frame(self._capture, self.buffers)
        if not ok or image is None:
            raise SourceError(f"camera {self.spec.device} stopped delivering frames (unplugged or stalled)")
        return as_bgr(image)

    def close(self) -> None:
        release(self._capture)
        self._capture = None
