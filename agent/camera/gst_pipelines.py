"""GStreamer pipelines the agent builds for a camera: what decodes and scales where (pure functions).

On a Jetson the CPU, not the GPU, caps a camera pipeline, and the costliest CPU passes are over
full-size pixels: decoding, colour conversion and the resize to the model's input. The Jetson
platform has hardware for each: NVDEC (``nvv4l2decoder``) decodes H.264/H.265, the ISP
(``nvarguscamerasrc``) delivers CSI frames, and the VIC (``nvvidconv``) converts and scales in
NVMM memory. So the pipelines built here decode in hardware and scale to the slot's input size
(aspect kept when the preprocess spec letterboxes) before a frame is copied to CPU memory; the
CPU's only pass is ``videoconvert`` dropping the padding byte of BGRx at the model's size.

Where the elements are missing (a desktop, a container without the NVIDIA plugins) the same
camera gets a software pipeline (``avdec_h26x``, ``videoscale``), scaled the same way so the
agent's frames are the same size. A CSI camera has no software path.

The VIC's bilinear filter is not OpenCV's ``INTER_LINEAR``: hardware-scaled frames differ from
CPU-resized ones by a few grey levels at edges. Detections are mapped back to the camera's own
pixels (:func:`agent.camera.preprocess.in_native_pixels`), so results do not depend on where
the frame was scaled.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath

from agent.camera.preprocess import resize_fit
from agent.camera.source_spec import (
    CsiCamera,
    EncodedFile,
    GStreamerCamera,
    GStreamerSourceSpec,
    RtspCamera,
    SourceSpec,
)
from agent.errors import SourceError
from agent.specs.preprocess import PreprocessSpec

#: The Jetson elements each kind of camera needs for its hardware pipeline.
HARDWARE_ELEMENTS: dict[str, tuple[str, ...]] = {
    "csi": ("nvarguscamerasrc", "nvvidconv"),
    "rtsp": ("nvv4l2decoder", "nvvidconv"),
    "file": ("nvv4l2decoder", "nvvidconv"),
}

#: Demuxer per file suffix; a raw elementary stream (``.h264``, ``.265``) needs none.
_DEMUXERS = {
    ".mp4": "qtdemux",
    ".mov": "qtdemux",
    ".m4v": "qtdemux",
    ".mkv": "matroskademux",
    ".webm": "matroskademux",
    ".ts": "tsdemux",
    ".m2ts": "tsdemux",
}
_RAW_SUFFIXES = {".h264": "h264", ".264": "h264", ".h265": "h265", ".265": "h265", ".hevc": "h265"}


@dataclass(frozen=True)
class BuiltPipeline:
    """A pipeline up to the sink, the frames it delivers, and why it runs where it runs."""

    pipeline: str
    width: int
    height: int
    #: The camera's own frame size (what boxes are mapped back to).
    native: tuple[int, int]
    hardware: bool
    reason: str


def elements_needed(camera: GStreamerCamera) -> tuple[str, ...]:
    """The Jetson elements the hardware pipeline of ``camera`` uses."""
    return HARDWARE_ELEMENTS[camera.kind]


def choose_hardware(mode: str, camera: GStreamerCamera, available: Iterable[str]) -> tuple[bool, str]:
    """Whether to build the hardware pipeline, and why (pure: ``available`` is what was probed).

    Raises :class:`SourceError` when ``mode`` is ``on`` and an element is missing, and for a CSI
    camera with ``off`` or without ``nvarguscamerasrc`` (it has no software path).
    """
    have = set(available)
    missing = [e for e in elements_needed(camera) if e not in have]
    if camera.kind == "csi" and (mode == "off" or "nvarguscamerasrc" in missing):
        raise SourceError(
            "a CSI camera is read only through nvarguscamerasrc (JetPack's gstreamer1.0 NVIDIA plugins); "
            + ("set hardware: auto or on" if mode == "off" else "it is not installed here")
        )
    if mode == "off":
        return False, "hardware: off"
    if missing:
        if mode == "on":
            raise SourceError(
                f"hardware: on, but GStreamer has no {', '.join(missing)} here "
                "(JetPack's NVIDIA GStreamer plugins); set hardware: auto to fall back to software"
            )
        return False, f"software: GStreamer has no {', '.join(missing)} here"
    return True, f"hardware: {' and '.join(elements_needed(camera))} found"


def delivered_size(native_w: int, native_h: int, scale_to: PreprocessSpec | None) -> tuple[int, int]:
    """The frame size the pipeline delivers: the slot's input (fitted when it letterboxes), or native.

    For a letterbox input the frame is scaled to the fitted size with the aspect kept (1920x1080 into
    640x640 gives 640x360); the CPU then only pads it, at the model's size.
    """
    if scale_to is None:
        return native_w, native_h
    fit = resize_fit(native_w, native_h, scale_to)
    return fit.new_w, fit.new_h


def build_pipeline(spec: GStreamerSourceSpec, available: Iterable[str]) -> BuiltPipeline:
    """The pipeline for ``spec.camera`` given the GStreamer elements ``available`` here (pure)."""
    camera = spec.camera
    if camera is None:
        raise SourceError("build_pipeline needs a camera; a hand-written pipeline is used as written")
    hardware, reason = choose_hardware(spec.hardware, camera, available)
    native = (camera.width, camera.height)
    scale_to = spec.scale_to if spec.scale == "auto" else None
    width, height = delivered_size(*native, scale_to)
    head = _source(camera, hardware)
    if hardware:
        # nvvidconv writes BGRx (the VIC has no packed 24-bit format); videoconvert drops the
        # fourth byte on the CPU, at the scaled size.
        tail = f"nvvidconv ! video/x-raw,format=BGRx,width={width},height={height} ! videoconvert"
    else:
        tail = f"videoscale ! video/x-raw,width={width},height={height} ! videoconvert"
    pipeline = f"{head} ! {tail} ! video/x-raw,format=BGR,width={width},height={height}"
    if (width, height) != native:
        reason += f"; scaled from {native[0]}x{native[1]} to {width}x{height}"
    return BuiltPipeline(pipeline, width, height, native, hardware, reason)


def _source(camera: GStreamerCamera, hardware: bool) -> str:
    if isinstance(camera, CsiCamera):
        return (
            f"nvarguscamerasrc sensor-id={camera.sensor_id} ! "
            f"video/x-raw(memory:NVMM),width={camera.width},height={camera.height},"
            f"framerate={framerate(camera.fps)}"
        )
    decode = _decoder(camera.codec, hardware)
    if isinstance(camera, RtspCamera):
        depay = "rtph264depay" if camera.codec == "h264" else "rtph265depay"
        return f"rtspsrc location={shlex.quote(camera.url)} latency={camera.latency_ms} ! {depay} ! {decode}"
    return f"filesrc location={shlex.quote(str(camera.path))} ! {_demux(camera)}{decode}"


def framerate(fps: float) -> str:
    """``fps`` as a caps fraction: ``30/1``, the NTSC rates as ``30000/1001``, else the nearest n/100."""
    whole = round(fps)
    if abs(fps - whole) < 1e-6:
        return f"{whole}/1"
    ntsc = round(fps * 1.001)
    if abs(fps - ntsc * 1000 / 1001) < 1e-3:
        return f"{ntsc * 1000}/1001"
    rate = Fraction(fps).limit_denominator(100)
    return f"{rate.numerator}/{rate.denominator}"


def _decoder(codec: str, hardware: bool) -> str:
    parse = "h264parse" if codec == "h264" else "h265parse"
    if hardware:
        return f"{parse} ! nvv4l2decoder"
    return f"{parse} ! avdec_{codec}"


def _demux(camera: EncodedFile) -> str:
    suffix = PurePath(camera.path).suffix.lower()
    if suffix in _RAW_SUFFIXES:
        if _RAW_SUFFIXES[suffix] != camera.codec:
            raise SourceError(
                f"{camera.path} is a raw {_RAW_SUFFIXES[suffix]} stream but codec says {camera.codec}"
            )
        return ""
    demuxer = _DEMUXERS.get(suffix)
    if demuxer is None:
        known = ", ".join(sorted({*_DEMUXERS, *_RAW_SUFFIXES}))
        raise SourceError(
            f"{camera.path}: no demuxer for {suffix or 'a file without a suffix'}; known suffixes: {known}"
        )
    return f"{demuxer} ! "


def scaled_for(source: SourceSpec, preprocess: PreprocessSpec) -> SourceSpec:
    """``source`` with the input its frames are scaled for, when it is a camera pipeline that scales.

    The agent calls this with the stream's slot's preprocess spec (its loaded model's, else the
    configured one). A hand-written pipeline, ``scale: off`` or an explicit ``scale_to`` is kept.
    """
    if not isinstance(source, GStreamerSourceSpec) or source.camera is None:
        return source
    if source.scale != "auto" or source.scale_to is not None:
        return source
    return source.model_copy(update={"scale_to": preprocess})
