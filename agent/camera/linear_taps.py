"""OpenCV's ``INTER_LINEAR`` resize of uint8 images as tables, so another device can repeat it exactly.

``cv2.resize`` on 8-bit images does not compute a float bilinear blend: it samples at the
half-pixel centre ``(d + 0.5) * src / dst - 0.5`` (in float32), clamps the columns (and their
weights) at the edges, clamps the rows (but not their weights), quantises both weights to 11 bits
(``INTER_RESIZE_COEF_SCALE = 2048``) and combines the two row sums with a fixed-point rounding
(``VResizeLinear`` for ``uchar``: ``((b0 * (h0 >> 4)) >> 16) + ((b1 * (h1 >> 4)) >> 16) + 2) >> 2``).
A float bilinear kernel differs from it by one grey level on a sizeable share of pixels.

:func:`linear_taps` computes, per output column and row, the two source indices and the two
integer weights; :func:`blend` is that fixed-point formula. The GPU preprocessing kernel
(:mod:`agent.camera.gpu_preprocess`) gathers with the same tables and the same formula, and the
tests check a numpy gather with these tables against ``cv2.resize`` bit for bit (x86 OpenCV; on
ARM OpenCV's carotene HAL may round differently by one level, which the stated tolerance covers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.errors import SourceError

#: OpenCV's ``INTER_RESIZE_COEF_SCALE``: bilinear weights are integers out of 2048.
COEF_SCALE = 2048

Int32s = npt.NDArray[np.int32]


@dataclass(frozen=True)
class AxisTaps:
    """For each output index along one axis: the two source indices and their integer weights."""

    first: Int32s
    second: Int32s
    weight_first: Int32s
    weight_second: Int32s


@dataclass(frozen=True)
class LinearTaps:
    """Column and row taps of one ``src -> dst`` resize."""

    columns: AxisTaps
    rows: AxisTaps


def linear_taps(src_w: int, src_h: int, dst_w: int, dst_h: int) -> LinearTaps:
    """The taps ``cv2.resize(..., interpolation=INTER_LINEAR)`` uses for uint8 images (pure)."""
    for what, value in (
        ("source width", src_w),
        ("source height", src_h),
        ("width", dst_w),
        ("height", dst_h),
    ):
        if value <= 0:
            raise SourceError(f"resize {what} is {value}; it must be positive")
    return LinearTaps(_axis(src_w, dst_w, clamp_weights=True), _axis(src_h, dst_h, clamp_weights=False))


def _axis(src: int, dst: int, *, clamp_weights: bool) -> AxisTaps:
    scale = 1.0 / (dst / src)  # OpenCV: scale_x = 1. / inv_scale_x, in double
    pos = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    index = np.floor(pos).astype(np.int32)
    frac = (pos - index.astype(np.float32)).astype(np.float32)
    if clamp_weights:
        # Columns outside the frame take the edge pixel with all the weight (HResizeLinear's xmin/xmax).
        outside = (index < 0) | (index >= src - 1)
        frac[outside] = 0.0
        index = np.clip(index, 0, src - 1)
    # saturate_cast<short>(w * 2048) rounds half to even, as np.rint does.
    weight_first = np.rint((np.float32(1.0) - frac) * np.float32(COEF_SCALE)).astype(np.int32)
    weight_second = np.rint(frac * np.float32(COEF_SCALE)).astype(np.int32)
    # Rows outside the frame read the edge row with their weights unchanged (the row fetch clips).
    first = np.clip(index, 0, src - 1).astype(np.int32)
    second = np.clip(index + 1, 0, src - 1).astype(np.int32)
    return AxisTaps(first, second, weight_first, weight_second)


def blend(
    row_first: npt.NDArray[np.int32],
    row_second: npt.NDArray[np.int32],
    weight_first: npt.NDArray[np.int32],
    weight_second: npt.NDArray[np.int32],
) -> npt.NDArray[np.int32]:
    """OpenCV's vertical fixed-point step: two horizontal sums (pixel x 2048 scale) to one uint8 value."""
    return (((weight_first * (row_first >> 4)) >> 16) + ((weight_second * (row_second >> 4)) >> 16) + 2) >> 2


def resize_with_taps(image: npt.NDArray[np.uint8], taps: LinearTaps) -> npt.NDArray[np.uint8]:
    """A ``H x W x C`` uint8 image resized by gathering with ``taps`` (numpy: what the GPU repeats)."""
    cols, rows = taps.columns, taps.rows
    pixels = image.astype(np.int32)
    a0 = cols.weight_first[None, :, None]
    a1 = cols.weight_second[None, :, None]
    top = pixels[rows.first]
    bottom = pixels[rows.second]
    sum_top = top[:, cols.first] * a0 + top[:, cols.second] * a1
    sum_bottom = bottom[:, cols.first] * a0 + bottom[:, cols.second] * a1
    out = blend(sum_top, sum_bottom, rows.weight_first[:, None, None], rows.weight_second[:, None, None])
    return out.astype(np.uint8)
