"""OnnxSlim before every engine build: the bundled models slim to the same outputs, cached by input hash.

Real onnxslim on real models: the shapes classifier shipped in ``agent/assets`` and the model zoo's
classifier, MobileNet-like and YOLO-style detector graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from agent.demo.modelzoo import write_classifier, write_detector, write_mobilenet_like
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.slim import onnxslim_version, slim_model
from agent.engines.cache.key import model_sha256
from agent.engines.settings import EngineConfig
from agent.machine.platform import detect_platform
from agent.specs.build import BuildSpec

SHAPES = Path(__file__).resolve().parents[3] / "agent" / "assets" / "shapes_classifier.onnx"

MODELS: dict[str, Callable[[Path], Path]] = {
    "shapes-classifier": lambda d: SHAPES,
    "classifier": lambda d: write_classifier(d / "classifier.onnx", input_size=64),
    "mobilenet-like": lambda d: write_mobilenet_like(d / "mobilenet.onnx", input_size=96, num_classes=10),
    "yolov8-detector": lambda d: write_detector(d / "detector.onnx", input_size=128),
}


def _outputs(model: Path, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [np.asarray(o) for o in session.run(None, {name: x})]


def _input_for(model: Path) -> np.ndarray:
    dims = onnx.load(str(model)).graph.input[0].type.tensor_type.shape.dim
    shape = [d.dim_value if d.dim_value > 0 else 2 for d in dims]
    return np.random.default_rng(0).random(shape, dtype=np.float32)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_slimmed_bundled_model_gives_the_same_outputs(tmp_path: Path, name: str) -> None:
    model = MODELS[name](tmp_path)
    result = slim_model(model, model_sha256(model), tmp_path / "slim")
    assert not result.cached
    assert result.nodes_after <= result.nodes_before
    x = _input_for(model)
    for original, slimmed in zip(_outputs(model, x), _outputs(result.path, x), strict=True):
        assert original.shape == slimmed.shape
        assert float(np.max(np.abs(original - slimmed))) <= 1e-4
    again = slim_model(model, model_sha256(model), tmp_path / "slim")
    assert again.cached
    assert again.path == result.path
    assert (again.nodes_before, again.nodes_after) == (result.nodes_before, result.nodes_after)


def test_a_torn_cache_entry_is_slimmed_again(tmp_path: Path) -> None:
    sha = model_sha256(SHAPES)
    first = slim_model(SHAPES, sha, tmp_path)
    first.path.with_suffix(".json").write_text("{not json")
    again = slim_model(SHAPES, sha, tmp_path)
    assert not again.cached
    assert again.path == first.path


def test_every_build_is_slimmed_and_switching_it_off_changes_the_key(tmp_path: Path) -> None:
    builder = EngineBuilder(tmp_path / "state", EngineConfig(build_timeout_s=120), detect_platform())
    messages: list[str] = []
    slimmed = builder.build(SHAPES, BuildSpec(precision="fp32", device="cpu"), progress=messages.append)
    plain = builder.build(SHAPES, BuildSpec(precision="fp32", device="cpu", slim=False))
    assert slimmed.key != plain.key
    report = slimmed.effective["slim"]
    assert report["onnxslim_version"] == onnxslim_version()
    assert report["nodes_after"] <= report["nodes_before"]
    assert any(m.startswith("onnxslim ") for m in messages)
    assert "slim" not in plain.effective
    assert list((tmp_path / "state" / "slim").glob(f"{model_sha256(SHAPES)}-onnxslim*.onnx"))
