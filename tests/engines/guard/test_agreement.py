"""The INT8 accuracy guard on the real shapes model: a good INT8 model passes, a broken one is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import TensorProto, helper

from agent.backends.base import LoadOptions, Runner
from agent.backends.onnxruntime import OnnxRuntimeBackend
from agent.camera.frame import Frame
from agent.camera.preprocess import preprocess
from agent.datasets.shapes import MODEL_PATH, generate
from agent.engines.calibration.int8 import Int8Result, quantize_int8, quantize_with_ranges
from agent.engines.guard.agreement import GuardReport, agreement, check_int8
from agent.errors import BuildError
from agent.specs.preprocess import PreprocessSpec

SPEC = PreprocessSpec(width=64, height=64)
#: The default of EngineConfig.int8_agreement.
THRESHOLD = 0.97


def load(path: Path) -> Runner:
    return OnnxRuntimeBackend().load(path, LoadOptions())


@pytest.fixture(scope="module")
def guard_frames() -> npt.NDArray[np.uint8]:
    images, _ = generate(200, seed=30_001)
    return images


@pytest.fixture(scope="module")
def good_int8(tmp_path_factory: pytest.TempPathFactory) -> Int8Result:
    images, _ = generate(128, seed=10_002)
    batch = np.stack([preprocess(image, SPEC)[0] for image in images])
    return quantize_int8(MODEL_PATH, tmp_path_factory.mktemp("good"), [batch[:64], batch[64:]])


@pytest.fixture(scope="module")
def fp32_runner() -> Iterator[Runner]:
    runner = load(MODEL_PATH)
    yield runner
    runner.close()


def test_guard_accepts_a_well_calibrated_int8_model(
    fp32_runner: Runner, good_int8: Int8Result, guard_frames: npt.NDArray[np.uint8]
) -> None:
    int8_runner = load(good_int8.model_path)
    report = agreement(fp32_runner, int8_runner, guard_frames, SPEC)
    assert report.n == 200
    assert report.output == "scores"
    assert report.agreement >= THRESHOLD
    assert 0.0 < report.mean_abs_diff <= report.max_abs_diff  # INT8 is close, not identical
    ok, reason = check_int8(report, THRESHOLD)
    assert ok, reason
    assert "agrees with FP32" in reason


def test_guard_rejects_int8_with_corrupted_ranges(
    tmp_path: Path, fp32_runner: Runner, good_int8: Int8Result, guard_frames: npt.NDArray[np.uint8]
) -> None:
    """A range squeezed 50x (as from a degenerate calibration set) saturates: the guard must refuse it."""
    broken = {
        name: (lo / 50.0, hi / 50.0) if name.startswith("conv2") else (lo, hi)
        for name, (lo, hi) in good_int8.ranges.items()
    }
    bad = quantize_with_ranges(MODEL_PATH, tmp_path, broken, method="entropy")
    report = agreement(fp32_runner, load(bad.model_path), guard_frames, SPEC)
    assert report.agreement < THRESHOLD
    ok, reason = check_int8(report, THRESHOLD)
    assert not ok
    assert "below the required 97.0%" in reason
    assert "falling back to FP16/FP32" in reason


def test_guard_rejects_int8_calibrated_on_blank_frames(
    tmp_path: Path, fp32_runner: Runner, guard_frames: npt.NDArray[np.uint8]
) -> None:
    """Calibrating on a covered lens (uniform grey frames) gives ranges that do not fit real scenes."""
    grey = np.full((16, 64, 64, 3), 128, dtype=np.uint8)
    batch = np.stack([preprocess(image, SPEC)[0] for image in grey])
    bad = quantize_int8(MODEL_PATH, tmp_path, [batch], method="minmax")
    report = agreement(fp32_runner, load(bad.model_path), guard_frames, SPEC)
    assert not check_int8(report, THRESHOLD)[0]


def test_frames_objects_and_callable_preprocess_give_the_same_report(
    fp32_runner: Runner, good_int8: Int8Result, guard_frames: npt.NDArray[np.uint8]
) -> None:
    int8_runner = load(good_int8.model_path)
    frames = [Frame("cam", i, image, 0.0, 0.0) for i, image in enumerate(guard_frames[:40])]

    def as_tensor(image: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
        return preprocess(image, SPEC)[0]

    by_spec = agreement(fp32_runner, int8_runner, guard_frames[:40], SPEC, batch=7)
    by_frame = agreement(fp32_runner, int8_runner, frames, as_tensor, batch=40)
    assert by_spec.n == by_frame.n == 40
    assert by_spec.agreement == by_frame.agreement
    assert by_spec.mean_abs_diff == pytest.approx(by_frame.mean_abs_diff, rel=1e-6)


def test_no_frames_means_no_int8() -> None:
    report = GuardReport(n=0, agreement=0.0, mean_abs_diff=0.0, max_abs_diff=0.0, output="scores")
    ok, reason = check_int8(report, 0.5)
    assert not ok
    assert "no held-out frames" in reason


@pytest.mark.parametrize(
    ("share", "threshold", "ok"),
    [(0.97, 0.97, True), (0.9699, 0.97, False), (1.0, 1.0, True), (0.0, 0.0, True)],
)
def test_threshold_is_inclusive(share: float, threshold: float, ok: bool) -> None:
    report = GuardReport(n=100, agreement=share, mean_abs_diff=0.1, max_abs_diff=0.5, output="scores")
    assert check_int8(report, threshold)[0] is ok


def test_report_is_json_ready() -> None:
    report = GuardReport(n=3, agreement=1.0, mean_abs_diff=0.25, max_abs_diff=0.5, output="scores")
    assert report.to_dict() == {
        "n": 3,
        "agreement": 1.0,
        "mean_abs_diff": 0.25,
        "max_abs_diff": 0.5,
        "output": "scores",
    }


def test_a_different_network_is_a_build_error(
    tmp_path: Path, fp32_runner: Runner, guard_frames: npt.NDArray[np.uint8]
) -> None:
    """An 'INT8' model with another output shape is not the same network: refused, not compared."""
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["scores"], axis=1),
        ],
        "other",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, 64, 64])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "other.onnx"))
    with pytest.raises(BuildError, match="not the same network"):
        agreement(fp32_runner, load(tmp_path / "other.onnx"), guard_frames[:4], SPEC)
    with pytest.raises(BuildError, match="no output 'logits'"):
        agreement(fp32_runner, fp32_runner, guard_frames[:4], SPEC, output="logits")
