"""Turn a camera frame into one model input tensor, and map model boxes back to the frame.

Pure functions on the per-frame path: OpenCV does the resize, padding and normalisation, writing
each channel straight into the output tensor, so a frame costs one resize, one (optional) pad and
one pass over the pixels per channel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import cv2
import numpy as np
import numpy.typing as npt

from agent.errors import SourceError
from agent.specs.preprocess import PreprocessSpec

#: OpenCV channel index of each RGB / BGR channel in a BGR image.
_CHANNELS = {"rgb": (2, 1, 0), "bgr": (0, 1, 2)}


@dataclass(frozen=True)
class Letterbox:
    """Geometry of the source-to-model resize: ``model = source * scale + pad`` per axis.

    ``pad_x``/``pad_y`` are in model pixels (zero for a stretch resize); ``src_width``/``src_height``
    is the frame size, used to clip boxes mapped back to it.
    """

    scale_x: float
    scale_y: float
    pad_x: float
    pad_y: float
    src_width: int
    src_height: int


def preprocess(image: npt.NDArray[np.uint8], spec: PreprocessSpec) -> tuple[npt.NDArray[Any], Letterbox]:
    """Resize, reorder, normalise and lay out one BGR ``H x W x 3`` frame as the model expects.

    Returns one item without a batch axis (``3 x H x W`` for ``nchw``, ``H x W x 3`` for ``nhwc``)
    in ``spec.dtype``, and the :class:`Letterbox` that maps model pixels back to the frame. Float
    inputs get ``(pixel * scale - mean) / std``; ``uint8`` inputs get the raw pixels.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise SourceError(
            f"frame is {image.dtype} with shape {image.shape}; preprocessing needs H x W x 3 uint8 BGR"
        )
    resized, lb = _resize(image, spec)
    order = _CHANNELS[spec.color]
    if spec.dtype == "uint8":
        return _layout_uint8(resized, order, spec.layout), lb
    tensor = _normalise(resized, order, spec, *_coefficients(spec))
    if spec.dtype == "float16":
        tensor = tensor.astype(np.float16)
    return tensor, lb


def boxes_to_source(boxes_xyxy: npt.NDArray[Any], lb: Letterbox) -> npt.NDArray[np.float32]:
    """Map ``(n, 4)`` ``x1, y1, x2, y2`` boxes from model-input pixels to frame pixels, clipped to it."""
    boxes = np.asarray(boxes_xyxy, dtype=np.float32).reshape(-1, 4)
    offset = np.array([lb.pad_x, lb.pad_y, lb.pad_x, lb.pad_y], dtype=np.float32)
    scale = np.array([lb.scale_x, lb.scale_y, lb.scale_x, lb.scale_y], dtype=np.float32)
    out = (boxes - offset) / scale
    np.clip(out[:, 0::2], 0.0, float(lb.src_width), out=out[:, 0::2])
    np.clip(out[:, 1::2], 0.0, float(lb.src_height), out=out[:, 1::2])
    return out


def in_native_pixels(lb: Letterbox, native: tuple[int, int] | None) -> Letterbox:
    """``lb`` of a frame that was scaled from a ``native``-sized camera frame before the agent got it
    (hardware scaling, :mod:`agent.camera.gst_pipelines`), mapping model pixels to the camera's own.

    ``model = frame * scale + pad`` and ``frame = native * frame_size / native_size``, so only the
    scales and the clipping size change. None (no scaling upstream) returns ``lb`` as is.
    """
    if native is None or native == (lb.src_width, lb.src_height):
        return lb
    native_w, native_h = native
    return Letterbox(
        lb.scale_x * lb.src_width / native_w,
        lb.scale_y * lb.src_height / native_h,
        lb.pad_x,
        lb.pad_y,
        native_w,
        native_h,
    )


def _u8(image: Any) -> npt.NDArray[np.uint8]:
    """OpenCV keeps the dtype of its input; its stubs just do not say so."""
    return cast("npt.NDArray[np.uint8]", image)


@dataclass(frozen=True)
class ResizeFit:
    """Where the resized frame lands in the model input: ``new_w x new_h`` pixels at ``left, top``.

    The rest of the input is padding (letterbox only). Both the CPU path and the GPU path
    (:mod:`agent.camera.gpu_preprocess`) take their geometry from :func:`resize_fit`, so they agree.
    """

    new_w: int
    new_h: int
    left: int
    top: int
    letterbox: Letterbox


def resize_fit(src_w: int, src_h: int, spec: PreprocessSpec) -> ResizeFit:
    """The resize geometry of a ``src_w x src_h`` frame into ``spec``'s input (pure)."""
    if src_w <= 0 or src_h <= 0:
        raise SourceError(f"frame is {src_w}x{src_h}; preprocessing needs a non-empty frame")
    if spec.resize == "stretch":
        lb = Letterbox(spec.width / src_w, spec.height / src_h, 0.0, 0.0, src_w, src_h)
        return ResizeFit(spec.width, spec.height, 0, 0, lb)
    ratio = min(spec.width / src_w, spec.height / src_h)
    new_w = min(spec.width, max(1, round(src_w * ratio)))
    new_h = min(spec.height, max(1, round(src_h * ratio)))
    left = (spec.width - new_w) // 2
    top = (spec.height - new_h) // 2
    # The scales are those of the rounded resized size, so boxes map back exactly to the frame.
    lb = Letterbox(new_w / src_w, new_h / src_h, float(left), float(top), src_w, src_h)
    return ResizeFit(new_w, new_h, left, top, lb)


def channel_gain_bias(spec: PreprocessSpec) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(x * scale - mean) / std`` folded into ``x * gain - bias`` per model channel (pure)."""
    gain = tuple(spec.scale / s for s in spec.std)
    bias = tuple(m / s for m, s in zip(spec.mean, spec.std, strict=True))
    return gain, bias


# Per frame, the geometry and the coefficients are the same as for the previous frame of the stream:
# computed once per (spec, frame size) instead of per frame: on a small model input that Python
# costs about as much as the resize and normalisation themselves. Specs are frozen, hashable models.
@functools.lru_cache(maxsize=64)
def _fit(src_w: int, src_h: int, spec: PreprocessSpec) -> ResizeFit:
    return resize_fit(src_w, src_h, spec)


@functools.lru_cache(maxsize=64)
def _coefficients(spec: PreprocessSpec) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    gains, biases = channel_gain_bias(spec)
    return np.asarray(gains, dtype=np.float64), np.asarray(biases, dtype=np.float64)


def channel_sources(spec: PreprocessSpec) -> tuple[int, int, int]:
    """Index in the BGR frame of each model channel, in the model's order (pure)."""
    return _CHANNELS[spec.color]


def _resize(image: npt.NDArray[np.uint8], spec: PreprocessSpec) -> tuple[npt.NDArray[np.uint8], Letterbox]:
    src_h, src_w = image.shape[:2]
    fit = _fit(src_w, src_h, spec)
    if (fit.new_w, fit.new_h) != (src_w, src_h):
        image = _u8(cv2.resize(image, (fit.new_w, fit.new_h), interpolation=cv2.INTER_LINEAR))
    if (fit.new_w, fit.new_h) != (spec.width, spec.height):
        image = _u8(
            cv2.copyMakeBorder(
                image,
                fit.top,
                spec.height - fit.new_h - fit.top,
                fit.left,
                spec.width - fit.new_w - fit.left,
                cv2.BORDER_CONSTANT,
                value=(spec.pad_value,) * 3,
            )
        )
    return image, fit.letterbox


def _layout_uint8(image: npt.NDArray[np.uint8], order: tuple[int, int, int], layout: str) -> npt.NDArray[Any]:
    if layout == "nchw":
        out = np.empty((3, *image.shape[:2]), dtype=np.uint8)
        for dst, src in enumerate(order):
            out[dst] = image[:, :, src]
        return out
    if order == (0, 1, 2):
        return np.ascontiguousarray(image)
    return _u8(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))


def _normalise(
    image: npt.NDArray[np.uint8],
    order: tuple[int, int, int],
    spec: PreprocessSpec,
    gain: npt.NDArray[np.float64],
    bias: npt.NDArray[np.float64],
) -> npt.NDArray[Any]:
    # (x * scale - mean) / std folded into x * gain - bias: one OpenCV pass per value, computed in
    # float and written straight in the output type (numpy's float16 cast is ~20x slower on x86).
    height, width = image.shape[:2]
    if spec.layout == "nchw":
        depth, dtype = (cv2.CV_16F, np.float16) if spec.dtype == "float16" else (cv2.CV_32F, np.float32)
        out = np.empty((3, height, width), dtype=dtype)
        planes = cv2.split(image)  # contiguous planes: ~3x faster than strided channel reads
        for dst, src in enumerate(order):
            plane = planes[src]
            res = cv2.addWeighted(plane, gain[dst], plane, 0.0, -bias[dst], dst=out[dst], dtype=depth)
            if not np.shares_memory(res, out):  # OpenCV reallocated instead of writing in place
                out[dst] = res
        return out
    if order != (0, 1, 2):
        image = _u8(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))
    # Broadcasting over a trailing axis of 3 is slow in numpy (and cv2.transform into a fresh
    # float image slower still); rows of W*3 values with tiled coefficients run at full speed.
    rows = np.ascontiguousarray(image).reshape(height, width * 3)
    flat = np.empty((height, width * 3), dtype=np.float32)
    np.multiply(rows, np.tile(gain.astype(np.float32), width), out=flat, dtype=np.float32)
    np.subtract(flat, np.tile(bias.astype(np.float32), width), out=flat)
    if spec.dtype == "float16":
        # Into a numpy-allocated buffer: arrays OpenCV allocates itself are several times slower here.
        half = np.empty(flat.shape, dtype=np.float16)
        res = cv2.addWeighted(flat, 1.0, flat, 0.0, 0.0, dst=half, dtype=cv2.CV_16F)
        if not np.shares_memory(res, half):
            half[...] = res
        return half.reshape(height, width, 3)
    return flat.reshape(height, width, 3)
