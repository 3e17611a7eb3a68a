"""The INTER_LINEAR taps: a numpy gather with them equals ``cv2.resize`` bit for bit.

This is what lets the GPU kernel (agent/camera/gpu_preprocess.py), which gathers with the same
tables and the same fixed-point formula, match the CPU path exactly rather than within a float
bilinear's one-grey-level error on many pixels.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from agent.camera.linear_taps import COEF_SCALE, linear_taps, resize_with_taps
from agent.errors import SourceError

SIZES = [
    (1920, 1080, 640, 360),  # 3x down
    (1920, 1080, 640, 640),  # stretch, different factors per axis
    (640, 480, 224, 224),
    (1280, 720, 640, 360),  # exactly 2x: OpenCV switches to INTER_AREA here, same values
    (100, 70, 224, 224),  # up
    (333, 217, 160, 96),  # odd factors
    (7, 5, 224, 224),  # tiny source: every edge rule
    (50, 40, 50, 80),  # one axis unchanged
    (640, 360, 640, 360),  # identity
]


@pytest.mark.parametrize(("src_w", "src_h", "dst_w", "dst_h"), SIZES)
def test_gather_with_taps_equals_cv2_resize_exactly(src_w: int, src_h: int, dst_w: int, dst_h: int) -> None:
    image = np.random.default_rng(src_w * dst_h).integers(0, 256, (src_h, src_w, 3), dtype=np.uint8)
    expected = cv2.resize(image, (dst_w, dst_h), interpolation=cv2.INTER_LINEAR)
    got = resize_with_taps(image, linear_taps(src_w, src_h, dst_w, dst_h))
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_a_float_bilinear_would_not_be_exact() -> None:
    """Why the tables carry OpenCV's integer weights: the plain float formula misses on many pixels."""
    image = np.random.default_rng(1).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    expected = cv2.resize(image, (640, 640), interpolation=cv2.INTER_LINEAR).astype(np.int32)
    taps = linear_taps(1920, 1080, 640, 640)
    wx = taps.columns.weight_second[None, :, None] / COEF_SCALE
    wy = taps.rows.weight_second[:, None, None] / COEF_SCALE
    px = image.astype(np.float64)
    top = (
        px[taps.rows.first][:, taps.columns.first] * (1 - wx)
        + px[taps.rows.first][:, taps.columns.second] * wx
    )
    bottom = (
        px[taps.rows.second][:, taps.columns.first] * (1 - wx)
        + px[taps.rows.second][:, taps.columns.second] * wx
    )
    float_blend = np.rint(top * (1 - wy) + bottom * wy).astype(np.int32)
    assert np.abs(float_blend - expected).max() == 1
    assert (float_blend != expected).mean() > 0.01


def test_edges_take_the_edge_pixel() -> None:
    taps = linear_taps(4, 4, 16, 16)
    cols, rows = taps.columns, taps.rows
    # Upscaling by 4: the first columns sample left of pixel 0 and take it whole.
    assert cols.first[0] == 0
    assert cols.weight_first[0] == COEF_SCALE
    assert cols.weight_second[0] == 0
    assert cols.first[-1] == 3
    assert cols.weight_first[-1] == COEF_SCALE
    # Rows read the clipped edge row with their weights unchanged (OpenCV clips the row fetch only).
    assert rows.first[0] == rows.second[0] == 0
    assert rows.weight_first[0] + rows.weight_second[0] == COEF_SCALE
    assert rows.weight_second[0] != 0


@pytest.mark.parametrize("args", [(0, 10, 5, 5), (10, 10, 0, 5), (10, -1, 5, 5)])
def test_empty_sizes_are_refused_by_name(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(SourceError, match="must be positive"):
        linear_taps(*args)
