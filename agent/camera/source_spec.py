"""Camera source configuration: one model per source type, chosen by ``type``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from agent.model_base import StrictModel
from agent.specs.preprocess import PreprocessSpec


class Region(StrictModel):
    """A rectangle of the (rotated) frame, in fractions of its width and height: a region of
    interest that stays right when the camera comes back at another resolution."""

    x: float = Field(ge=0, lt=1, description="Left edge, as a fraction of the frame's width (0: the left).")
    y: float = Field(ge=0, lt=1, description="Top edge, as a fraction of the frame's height (0: the top).")
    width: float = Field(gt=0, le=1, description="Width, as a fraction of the frame's width.")
    height: float = Field(gt=0, le=1, description="Height, as a fraction of the frame's height.")

    @model_validator(mode="after")
    def _inside(self) -> Region:
        # A little rounding slack: 0.1 + 0.9 is 1.0000000000000002 in floats.
        if self.x + self.width > 1 + 1e-9 or self.y + self.height > 1 + 1e-9:
            raise ValueError(
                f"the region must lie inside the frame: x + width = {self.x + self.width:g} and "
                f"y + height = {self.y + self.height:g} must each be at most 1"
            )
        return self


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
    password_file: Path | None = Field(
        None,
        description="File holding the camera's password, put into the URL at open (the URL names the "
        "user: rtsp://user@cam/...); a configuration overlay delivers it sealed (password:).",
    )
    decode_threads: int = Field(
        0,
        ge=0,
        le=64,
        description="FFmpeg decoder threads; 0 = FFmpeg's default (one per core). 1 spends the least "
        "CPU per frame on streams up to 1080p, where one thread keeps up.",
    )
    open_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Longest wait for the camera to answer and send a playable stream."
    )
    read_timeout_s: float = Field(
        5.0,
        gt=0,
        le=120,
        description="Longest wait for one frame before the stream counts as stalled and is reopened "
        "(covers a camera whose socket stays open but sends nothing). Keep it above two frame intervals.",
    )


class CsiCamera(StrictModel):
    """A Jetson CSI camera through ``nvarguscamerasrc`` (the ISP), in one of its sensor modes."""

    kind: Literal["csi"] = "csi"
    sensor_id: int = Field(0, ge=0, le=15, description="nvarguscamerasrc sensor-id.")
    width: int = Field(1920, gt=0, le=8192, description="Sensor mode width.")
    height: int = Field(1080, gt=0, le=8192, description="Sensor mode height.")
    fps: float = Field(30.0, gt=0, le=1000, description="Sensor mode frame rate.")


class RtspCamera(StrictModel):
    """An H.264/H.265 RTSP camera, decoded by ``nvv4l2decoder`` (NVDEC) where the platform has it."""

    kind: Literal["rtsp"] = "rtsp"
    url: str = Field(pattern=r"^rtsps?://", description="rtsp:// address of the stream.")
    codec: Literal["h264", "h265"] = Field("h264", description="What the camera encodes.")
    width: int = Field(gt=0, le=8192, description="Frame width the camera sends (for the scaling geometry).")
    height: int = Field(gt=0, le=8192, description="Frame height the camera sends.")
    latency_ms: int = Field(200, ge=0, le=10000, description="rtspsrc jitter buffer.")


class EncodedFile(StrictModel):
    """An H.264/H.265 video file (mp4, mov, mkv, ts or a raw elementary stream)."""

    kind: Literal["file"] = "file"
    path: Path = Field(description="Video file to read.")
    codec: Literal["h264", "h265"] = Field("h264", description="What the file holds.")
    width: int = Field(gt=0, le=8192, description="Frame width in the file (for the scaling geometry).")
    height: int = Field(gt=0, le=8192, description="Frame height in the file.")


GStreamerCamera = Annotated[CsiCamera | RtspCamera | EncodedFile, Field(discriminator="kind")]


class GStreamerSourceSpec(_Reconnect):
    """A ``gst-launch-1.0`` pipeline run as a subprocess that writes raw BGR frames to stdout.

    Either a hand-written ``pipeline`` ending in a caps filter producing ``video/x-raw,format=BGR``
    at ``width`` x ``height`` (the agent appends ``! fdsink fd=1``), or a ``camera`` the agent builds
    the pipeline for (:mod:`agent.camera.gst_pipelines`): hardware decode (``nvv4l2decoder``),
    ``nvarguscamerasrc`` for CSI, and ``nvvidconv`` scaling on the VIC to the slot's input size
    before a frame reaches CPU memory, when the platform has those elements.
    """

    type: Literal["gstreamer"] = "gstreamer"
    pipeline: str | None = Field(None, description="Pipeline up to (not including) the sink.")
    width: int | None = Field(None, gt=0, description="Frame width the hand-written pipeline produces.")
    height: int | None = Field(None, gt=0, description="Frame height the hand-written pipeline produces.")
    camera: GStreamerCamera | None = Field(None, description="A camera the agent builds the pipeline for.")
    hardware: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Jetson elements (nvv4l2decoder, nvvidconv): auto = when gst-inspect-1.0 finds "
        "them, on = required (the source fails with the reason without them), off = software only.",
    )
    scale: Literal["auto", "off"] = Field(
        "auto", description="auto: scale to the stream's slot input before the agent; off: native size."
    )
    scale_to: PreprocessSpec | None = Field(
        None,
        description="Input the frames are scaled for; the agent fills it from the stream's slot "
        "when scale is auto.",
    )

    @model_validator(mode="after")
    def _pipeline_or_camera(self) -> GStreamerSourceSpec:
        if (self.pipeline is None) == (self.camera is None):
            raise ValueError("set either pipeline (with width and height) or camera, not both or neither")
        if self.pipeline is not None and (self.width is None or self.height is None):
            raise ValueError(
                "a hand-written pipeline needs width and height: the size of the frames it produces"
            )
        return self


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
