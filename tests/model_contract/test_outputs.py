"""validate_outputs: which model outputs a classification or detection postprocess can read."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.errors import EngineError
from agent.model_contract.outputs import validate_outputs
from agent.model_contract.tensors import TensorSpec
from agent.specs.postprocess import ClassificationSpec, DetectionSpec


def _classification(**fields: Any) -> ClassificationSpec:
    return ClassificationSpec.model_validate({"type": "classification", **fields})


def _detection(**fields: Any) -> DetectionSpec:
    return DetectionSpec.model_validate({"type": "detection", **fields})


@pytest.mark.parametrize(
    "shape",
    [("batch", 10), (1, 1000), ("batch", 1000, 1, 1), ("batch", "classes")],
)
def test_validate_accepts_vector_outputs(shape: tuple[Any, ...]) -> None:
    validate_outputs(_classification(), [TensorSpec("scores", shape, "float32")])


@pytest.mark.parametrize("shape", [("batch", 8400, 85), ("batch",), ("batch", 3, 224, 224)])
def test_validate_refuses_non_vector_outputs(shape: tuple[Any, ...]) -> None:
    with pytest.raises(EngineError, match="classification needs an output of shape"):
        validate_outputs(_classification(), [TensorSpec("out", shape, "float32")])


def test_validate_checks_output_name() -> None:
    outputs = [TensorSpec("a", ("batch", 3, 8, 8), "float32"), TensorSpec("b", ("batch", 10), "float32")]
    validate_outputs(_classification(output_name="b"), outputs)
    with pytest.raises(EngineError, match="classification"):
        validate_outputs(_classification(), outputs)  # first output is a feature map
    with pytest.raises(EngineError, match="'c'"):
        validate_outputs(_classification(output_name="c"), outputs)
    with pytest.raises(EngineError, match="no outputs"):
        validate_outputs(_classification(), [])


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        ("yolov8", ("batch", 84, 8400)),
        ("yolov8", ("batch", "channels", "boxes")),
        ("yolov5", ("batch", 25200, 85)),
        ("yolov5", (1, 25200, 6)),
    ],
)
def test_validate_accepts_detector_outputs(fmt: str, shape: tuple[Any, ...]) -> None:
    validate_outputs(_detection(format=fmt), [TensorSpec("output0", shape, "float32")])


@pytest.mark.parametrize(
    ("fmt", "shape", "match"),
    [
        ("yolov8", ("batch", 1000), "shape \\[batch, 4\\+classes, boxes\\]"),
        ("yolov8", ("batch", 4, 8400), "at least 5 values"),
        ("yolov5", ("batch", 25200, 5), "at least 6 values"),
        ("yolov5", ("batch", 3, 224, 224), "detection needs an output"),
    ],
)
def test_validate_refuses_incompatible_outputs(fmt: str, shape: tuple[Any, ...], match: str) -> None:
    with pytest.raises(EngineError, match=match):
        validate_outputs(_detection(format=fmt), [TensorSpec("output0", shape, "float32")])


def test_validate_warns_on_probably_swapped_layout() -> None:
    with capture_logs() as logs:
        validate_outputs(_detection(format="yolov5"), [TensorSpec("output0", ("batch", 84, 8400), "float32")])
    assert [e["event"] for e in logs] == ["postprocess.detection.layout_suspect"]
