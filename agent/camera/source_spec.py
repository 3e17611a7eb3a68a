"""Camera source configuration: one model per source type, chosen by ``type``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from agent.model_base import StrictModel


class _Reconnect(StrictModel):
    reconnect_min_s: float = Field(0.5, gt=0, description="First delay before reopening a lost source.")
    reconnect_max_s: float = Field(30.0, gt=0, description="Longest delay between reopen attempts.")


class FileSourceSpec(_Reconnect):
    """A video file decoded by OpenCV."""

    type: Literal["file"] = "file"
    path: Path = Field(description="Video file to read.")
    loop: bool = Field(True, description="Start again at the end (True) or end the stream (False).")
    realtime: bool = Field(False, description="Pace frames at the file's own frame rate.")
    decode_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="FFmpeg decoder threads. 0 = auto: 1 for frames up to 1920x1080 (the agent's "
        "other stages use the other cores), FFmpeg's default (one per core) above.",
    )


class V4L2SourceSpec(_Reconnect):
    """A V4L2 device (USB camera) read through OpenCV."""

    type: Literal["v4l2"] = "v4l2"
    device: str = Field("/dev/video0", description="Device node.")
    width: int | None = Field(None, gt=0, description="Requested capture width.")
    height: int | None = Field(None, gt=0, description="Requested capture height.")
    fps: float | None = Field(None, gt=0, description="Requested capture rate.")


class UrlSourceSpec(_Reconnect):
    """A network camera: RTSP or HTTP (MJPEG) URL, read through OpenCV/FFmpeg."""

    type: Literal["url"] = "url"
    url: str = Field(description="rtsp://, http:// or https:// address of the stream.")
    decode_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="FFmpeg decoder threads; 0 = FFmpeg's default (one per core). 1 spends the least "
        "CPU per frame on streams up to 1080p, where one thread keeps up.",
    )


class GStreamerSourceSpec(_Reconnect):
    """A ``gst-launch-1.0`` pipeline run as a subprocess that writes raw BGR frames to stdout.

    The pipeline must end in a caps filter producing ``video/x-raw,format=BGR`` at ``width`` x
    ``height``; the agent appends ``! fdsink fd=1``. This is how a Jetson CSI camera
    (``nvarguscamerasrc``) is read without OpenCV's GStreamer support, which the pip wheel lacks.
    """

    type: Literal["gstreamer"] = "gstreamer"
    pipeline: str = Field(description="Pipeline up to (not including) the sink.")
    width: int = Field(gt=0, description="Frame width the pipeline produces.")
    height: int = Field(gt=0, description="Frame height the pipeline produces.")


class SyntheticSourceSpec(_Reconnect):
    """A moving test pattern, for demos and tests."""

    type: Literal["synthetic"] = "synthetic"
    width: int = Field(640, gt=0)
    height: int = Field(480, gt=0)
    fps: float = Field(30.0, ge=0, description="Frame rate; 0 produces frames as fast as they are taken.")
    frames: int | None = Field(None, gt=0, description="End the stream after this many frames.")


SourceSpec = Annotated[
    FileSourceSpec | V4L2SourceSpec | UrlSourceSpec | GStreamerSourceSpec | SyntheticSourceSpec,
    Field(discriminator="type"),
]
