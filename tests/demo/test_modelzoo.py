"""Generated models: valid ONNX, run in ONNX Runtime at batch 1 and 3, documented shapes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest

from agent.backends.base import LoadOptions
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.camera.preprocess import preprocess
from agent.demo import modelzoo
from agent.errors import EngineError
from agent.model_contract.outputs import validate_outputs
from agent.postprocess.runner import Postprocessor
from agent.specs.postprocess import ClassificationSpec, DetectionSpec
from agent.specs.preprocess import PreprocessSpec


def _session(path: Path) -> Any:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _images(batch: int, size: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).random((batch, 3, size, size), dtype=np.float32)


def _synthetic_frame() -> npt.NDArray[np.uint8]:
    """A 640x480 BGR frame with two filled shapes on grey, as a test camera might show."""
    frame = np.full((480, 640, 3), 90, dtype=np.uint8)
    cv2.rectangle(frame, (100, 100), (300, 260), (0, 200, 255), thickness=-1)
    cv2.circle(frame, (450, 300), 80, (255, 50, 50), thickness=-1)
    return frame


CASES: list[tuple[str, Callable[..., Path], dict[str, Any], int, list[Any]]] = [
    ("classifier", modelzoo.write_classifier, {"input_size": 48, "num_classes": 7}, 48, ["batch", 7]),
    ("tiny", modelzoo.write_tiny_classifier, {}, 32, ["batch", 10]),
    ("detector_v8", modelzoo.write_detector, {"input_size": 160, "num_classes": 3}, 160, ["batch", 7, 100]),
    (
        "detector_v5",
        modelzoo.write_detector,
        {"fmt": "yolov5", "input_size": 160, "num_classes": 2},
        160,
        ["batch", 100, 7],
    ),
]


@pytest.mark.parametrize(("name", "write", "kwargs", "size", "out_shape"), CASES, ids=[c[0] for c in CASES])
def test_model_is_valid_and_runs(
    tmp_path: Path,
    name: str,
    write: Callable[..., Path],
    kwargs: dict[str, Any],
    size: int,
    out_shape: list[Any],
) -> None:
    path = write(tmp_path / f"{name}.onnx", **kwargs)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert model.ir_version == 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    session = _session(path)
    (images,) = session.get_inputs()
    assert (images.name, images.shape, images.type) == ("images", ["batch", 3, size, size], "tensor(float)")
    (output,) = session.get_outputs()
    assert output.shape == out_shape
    for batch in (1, 3):
        (result,) = session.run(None, {"images": _images(batch, size)})
        assert list(result.shape) == [batch, *out_shape[1:]]
        assert np.isfinite(result).all()


def test_batch_items_are_independent(tmp_path: Path) -> None:
    session = _session(modelzoo.write_classifier(tmp_path / "c.onnx", input_size=32))
    batch = _images(3, 32)
    (together,) = session.run(None, {"images": batch})
    (alone,) = session.run(None, {"images": batch[1:2]})
    np.testing.assert_allclose(together[1:2], alone, rtol=1e-5, atol=1e-6)
    assert not np.allclose(together[0], together[1])  # the output depends on the input


def test_seed_decides_weights(tmp_path: Path) -> None:
    a = modelzoo.write_classifier(tmp_path / "a.onnx", seed=1)
    again = modelzoo.write_classifier(tmp_path / "again.onnx", seed=1)
    b = modelzoo.write_classifier(tmp_path / "b.onnx", seed=2)
    assert a.read_bytes() == again.read_bytes()
    x = _images(1, 64)
    (out_a,) = _session(a).run(None, {"images": x})
    (out_b,) = _session(b).run(None, {"images": x})
    assert not np.allclose(out_a, out_b, atol=1e-3)


def test_mobilenet_like_is_mobilenet_sized(tmp_path: Path) -> None:
    path = modelzoo.write_mobilenet_like(tmp_path / "mnet.onnx", num_classes=1000)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    assert 3_500_000 < params < 5_000_000  # MobileNet v1 1.0: 4.2 M
    depthwise = [
        n
        for n in model.graph.node
        if n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute)
    ]
    assert len(depthwise) == 13
    session = _session(path)
    for batch in (1, 3):
        (scores,) = session.run(None, {"images": _images(batch, 224)})
        assert scores.shape == (batch, 1000)
        assert np.isfinite(scores).all()


def test_detector_rejects_size_off_the_grid(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        modelzoo.write_detector(tmp_path / "d.onnx", input_size=100)


@pytest.mark.parametrize("fmt", ["yolov8", "yolov5"])
def test_detector_boxes_are_sensible(tmp_path: Path, fmt: str) -> None:
    path = modelzoo.write_detector(tmp_path / "d.onnx", fmt=fmt, input_size=320, num_classes=3)  # type: ignore[arg-type]
    (out,) = _session(path).run(None, {"images": _images(2, 320)})
    rows = out.transpose(0, 2, 1) if fmt == "yolov8" else out  # [b, n, values]
    assert ((rows[..., :2] >= 0) & (rows[..., :2] <= 320)).all()  # centres inside the input
    assert ((rows[..., 2:4] > 0) & (rows[..., 2:4] <= 80)).all()  # sizes up to a quarter of it
    assert ((rows[..., 4:] >= 0) & (rows[..., 4:] <= 1)).all()  # scores are probabilities


@pytest.mark.parametrize("fmt", ["yolov8", "yolov5"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_with_postprocessor_detects(tmp_path: Path, fmt: str, seed: int) -> None:
    path = modelzoo.write_detector(tmp_path / "d.onnx", fmt=fmt, seed=seed)  # type: ignore[arg-type]
    session = _session(path)
    frame = _synthetic_frame()
    spec = PreprocessSpec.model_validate({"width": 320, "height": 320, "resize": "letterbox"})
    tensor, lb = preprocess(frame, spec)
    (out,) = session.run(None, {"images": tensor[None]})
    post = Postprocessor(
        DetectionSpec.model_validate({"type": "detection", "format": fmt, "labels": ["a", "b", "c"]})
    )
    prediction = post({"output0": out[0]}, lb)
    assert prediction.detections is not None
    assert len(prediction.detections) >= 1
    for det in prediction.detections:
        assert det.score >= 0.25
        assert det.label in {"a", "b", "c"}
        x1, y1, x2, y2 = det.box
        assert 0 <= x1 <= x2 <= 640
        assert 0 <= y1 <= y2 <= 480


def test_load_time_validation_of_zoo_models(tmp_path: Path) -> None:
    """The check run before a model goes live accepts the right postprocess and refuses a wrong one."""
    backend = OnnxRuntimeBackend()
    detector = backend.load(modelzoo.write_detector(tmp_path / "d.onnx", input_size=160), LoadOptions())
    classifier = backend.load(modelzoo.write_classifier(tmp_path / "c.onnx"), LoadOptions())
    detection = DetectionSpec.model_validate({"type": "detection"})
    classification = ClassificationSpec.model_validate({"type": "classification"})
    validate_outputs(detection, detector.outputs)
    validate_outputs(classification, classifier.outputs)
    with pytest.raises(EngineError, match="classification needs"):
        validate_outputs(classification, detector.outputs)
    with pytest.raises(EngineError, match="detection needs"):
        validate_outputs(detection, classifier.outputs)
