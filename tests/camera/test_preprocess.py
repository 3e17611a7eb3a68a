"""Preprocessing: tensor layout/dtype/colour, normalisation values, letterbox geometry round trips."""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import pytest

from agent.camera.preprocess import Letterbox, boxes_to_source, in_native_pixels, preprocess
from agent.errors import SourceError
from agent.specs.preprocess import PreprocessSpec

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _spec(**fields: Any) -> PreprocessSpec:
    # Validated like a config file would be (mypy cannot see pydantic's positional Field defaults).
    return PreprocessSpec.model_validate(fields)


def _gradient(height: int, width: int) -> npt.NDArray[np.uint8]:
    """A BGR image whose three channels differ everywhere, so a channel swap cannot go unnoticed."""
    ys, xs = np.mgrid[0:height, 0:width]
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[..., 0] = (xs * 255 // max(width - 1, 1)).astype(np.uint8)
    image[..., 1] = (ys * 255 // max(height - 1, 1)).astype(np.uint8)
    image[..., 2] = ((xs + ys) % 256).astype(np.uint8)
    return image


def _bright_box(image: npt.NDArray[Any]) -> tuple[float, float, float, float]:
    """x1, y1, x2, y2 (pixel edges) of the pixels brighter than half scale in an HxW(x3) image."""
    grey = image if image.ndim == 2 else image.max(axis=2)
    ys, xs = np.nonzero(grey > 127)
    return float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
@pytest.mark.parametrize("resize", ["stretch", "letterbox"])
def test_shape_dtype_and_layout(layout: str, dtype: str, resize: str) -> None:
    spec = _spec(width=96, height=64, layout=layout, dtype=dtype, resize=resize)
    tensor, _ = preprocess(_gradient(120, 200), spec)
    assert tensor.shape == ((3, 64, 96) if layout == "nchw" else (64, 96, 3))
    assert tensor.dtype == np.dtype(dtype)
    assert tensor.flags.c_contiguous


def test_nhwc_is_nchw_transposed() -> None:
    image = _gradient(50, 70)
    common = {"width": 40, "height": 30, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    chw, _ = preprocess(image, _spec(layout="nchw", **common))
    hwc, _ = preprocess(image, _spec(layout="nhwc", **common))
    np.testing.assert_allclose(chw.transpose(1, 2, 0), hwc, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_colour_order(layout: str) -> None:
    blue = np.zeros((8, 8, 3), dtype=np.uint8)
    blue[..., 0] = 255  # BGR: pure blue
    rgb, _ = preprocess(blue, _spec(width=8, height=8, layout=layout, color="rgb"))
    bgr, _ = preprocess(blue, _spec(width=8, height=8, layout=layout, color="bgr"))
    if layout == "nhwc":
        rgb, bgr = rgb.transpose(2, 0, 1), bgr.transpose(2, 0, 1)
    assert rgb[2].min() == 1.0
    assert rgb[0].max() == 0.0
    assert bgr[0].min() == 1.0
    assert bgr[2].max() == 0.0


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_normalisation_values_exact(layout: str) -> None:
    image = _gradient(32, 48)
    spec = _spec(
        width=48,
        height=32,
        layout=layout,
        color="rgb",
        scale=1 / 255,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    )
    tensor, lb = preprocess(image, spec)
    rgb = image[..., ::-1].astype(np.float64)
    expected = (rgb / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    if layout == "nchw":
        expected = expected.transpose(2, 0, 1)
    np.testing.assert_allclose(tensor, expected, rtol=0, atol=2e-6)
    assert lb == Letterbox(1.0, 1.0, 0.0, 0.0, 48, 32)


def test_default_scale_maps_pixels_to_unit_range() -> None:
    image = np.array([[[0, 51, 255]]], dtype=np.uint8)
    tensor, _ = preprocess(image, _spec(width=1, height=1, color="bgr"))
    np.testing.assert_allclose(tensor.ravel(), [0.0, 0.2, 1.0], atol=1e-7)


def test_uint8_is_raw_pixels_ignoring_normalisation() -> None:
    image = _gradient(16, 16)
    spec = _spec(width=16, height=16, dtype="uint8", color="rgb", mean=(9, 9, 9), std=(3, 3, 3))
    tensor, _ = preprocess(image, spec)
    np.testing.assert_array_equal(tensor, image[..., ::-1].transpose(2, 0, 1))


def test_float16_matches_float32() -> None:
    image = _gradient(40, 40)
    f32, _ = preprocess(image, _spec(width=20, height=20, mean=IMAGENET_MEAN, std=IMAGENET_STD))
    f16, _ = preprocess(
        image, _spec(width=20, height=20, dtype="float16", mean=IMAGENET_MEAN, std=IMAGENET_STD)
    )
    np.testing.assert_allclose(f16.astype(np.float32), f32, atol=5e-3)


def test_stretch_geometry() -> None:
    _, lb = preprocess(_gradient(480, 640), _spec(width=320, height=320))
    assert lb == Letterbox(0.5, 320 / 480, 0.0, 0.0, 640, 480)


@pytest.mark.parametrize(
    ("src_hw", "model_wh", "pad_xy"),
    [
        ((480, 640), (320, 320), (0.0, 40.0)),  # landscape: bars top and bottom
        ((640, 480), (320, 320), (40.0, 0.0)),  # portrait: bars left and right
        ((300, 300), (320, 256), (32.0, 0.0)),  # square frame, wide model input
    ],
)
def test_letterbox_geometry_and_padding(
    src_hw: tuple[int, int], model_wh: tuple[int, int], pad_xy: tuple[float, float]
) -> None:
    spec = _spec(width=model_wh[0], height=model_wh[1], resize="letterbox", dtype="uint8", pad_value=114)
    image = np.zeros((*src_hw, 3), dtype=np.uint8)
    tensor, lb = preprocess(image, spec)
    assert (lb.pad_x, lb.pad_y) == pad_xy
    assert lb.scale_x == pytest.approx(lb.scale_y, rel=0.01)  # aspect kept
    assert (lb.src_width, lb.src_height) == (src_hw[1], src_hw[0])
    pad_x, pad_y = int(pad_xy[0]), int(pad_xy[1])
    hw = tensor.transpose(1, 2, 0)
    content = hw[pad_y : model_wh[1] - pad_y, pad_x : model_wh[0] - pad_x]
    assert (content == 0).all()
    if pad_y:
        assert (hw[:pad_y] == 114).all()
        assert (hw[-pad_y:] == 114).all()
    if pad_x:
        assert (hw[:, :pad_x] == 114).all()
        assert (hw[:, -pad_x:] == 114).all()


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
@pytest.mark.parametrize(
    ("src_hw", "model_wh"), [((480, 640), (320, 320)), ((720, 405), (256, 320)), ((333, 517), (224, 224))]
)
def test_box_drawn_in_source_maps_back(
    resize: str, src_hw: tuple[int, int], model_wh: tuple[int, int]
) -> None:
    height, width = src_hw
    x1, y1, x2, y2 = int(width * 0.2), int(height * 0.3), int(width * 0.7), int(height * 0.8)
    image = np.zeros((height, width, 3), dtype=np.uint8)
    cv2.rectangle(image, (x1, y1), (x2 - 1, y2 - 1), (255, 255, 255), thickness=-1)
    spec = _spec(width=model_wh[0], height=model_wh[1], resize=resize, dtype="uint8", layout="nhwc")
    tensor, lb = preprocess(image, spec)
    found = np.array([_bright_box(tensor)], dtype=np.float32)
    mapped = boxes_to_source(found, lb)[0]
    # One model pixel is 1/scale source pixels; resampling can move an edge by about that much.
    tolerance = 1.0 / min(lb.scale_x, lb.scale_y) + 0.5
    np.testing.assert_allclose(mapped, [x1, y1, x2, y2], atol=tolerance)


def test_boxes_to_source_exact_and_clipped() -> None:
    lb = Letterbox(scale_x=0.5, scale_y=0.5, pad_x=0.0, pad_y=40.0, src_width=640, src_height=480)
    boxes = np.array([[10, 50, 110, 140], [-20, 0, 400, 400]], dtype=np.float32)
    out = boxes_to_source(boxes, lb)
    np.testing.assert_allclose(out[0], [20, 20, 220, 200])
    np.testing.assert_allclose(out[1], [0, 0, 640, 480])  # clipped to the frame
    assert boxes_to_source(np.zeros((0, 4), dtype=np.float32), lb).shape == (0, 4)


def test_input_already_at_size_is_not_resampled() -> None:
    image = _gradient(24, 32)
    tensor, lb = preprocess(image, _spec(width=32, height=24, dtype="uint8", color="bgr", layout="nhwc"))
    np.testing.assert_array_equal(tensor, image)
    assert lb == Letterbox(1.0, 1.0, 0.0, 0.0, 32, 24)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((10, 10), dtype=np.uint8),
        np.zeros((10, 10, 4), dtype=np.uint8),
        np.zeros((10, 10, 3), np.float32),
    ],
)
def test_bad_frame_is_a_source_error(bad: npt.NDArray[Any]) -> None:
    with pytest.raises(SourceError, match="H x W x 3 uint8"):
        preprocess(bad, _spec())


def test_boxes_of_a_frame_scaled_upstream_map_back_to_the_cameras_own_pixels() -> None:
    """Hardware scaling (a VIC in the GStreamer pipeline) delivers 640x360 of a 1920x1080 camera."""
    native = np.zeros((1080, 1920, 3), dtype=np.uint8)
    native[300:600, 900:1500] = 255
    scaled = np.asarray(cv2.resize(native, (640, 360), interpolation=cv2.INTER_AREA), dtype=np.uint8)
    spec = _spec(width=640, height=640, resize="letterbox")
    tensor, letterbox = preprocess(scaled, spec)
    box_in_model = np.array([_bright_box(tensor.transpose(1, 2, 0) * 255.0)])
    as_delivered = boxes_to_source(box_in_model, letterbox)
    np.testing.assert_allclose(as_delivered[0], [300, 100, 500, 200], atol=1)
    mapped = in_native_pixels(letterbox, (1920, 1080))
    assert (mapped.src_width, mapped.src_height) == (1920, 1080)
    np.testing.assert_allclose(boxes_to_source(box_in_model, mapped)[0], [900, 300, 1500, 600], atol=3)
    assert in_native_pixels(letterbox, None) is letterbox
    assert in_native_pixels(letterbox, (640, 360)) is letterbox
