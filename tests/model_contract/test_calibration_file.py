"""INT8 from the operator's calibration (``calibration: {kind: cache}``): no calibration run, same engine.

Real ONNX models, real build children; TensorRT is absent, so every plan goes to ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.settings import EngineConfig
from agent.errors import BuildError
from agent.model_contract.calibration_file import as_trt_cache, read_ranges
from agent.model_contract.calibration_table import write_table
from agent.model_contract.trt_cache import write_trt_cache
from agent.specs.build import BuildSpec, CalibrationSource
from tests.engines.building.test_builder import PLATFORM, frames, run


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


def builder_at(root: Path) -> EngineBuilder:
    return EngineBuilder(root, EngineConfig(build_timeout_s=120), PLATFORM)


def test_a_second_device_builds_the_same_int8_engine_from_the_first_ones_table(
    tmp_path: Path, model: Path
) -> None:
    first = builder_at(tmp_path / "first")
    calibrated = first.build(
        model,
        BuildSpec(precision="int8", device="cpu", calibration=CalibrationSource(kind="stream", frames=12)),
        calibration=frames(1),
    )
    assert calibrated.effective["calibration"]["source"] == "frames"
    table = Path(calibrated.effective["calibration"]["table"])

    second = builder_at(tmp_path / "second")
    messages: list[str] = []
    given = second.build(
        model,
        BuildSpec(precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", path=table)),
        progress=messages.append,
    )
    assert given.effective["calibration"]["source"] == "given"
    assert any("no calibration run" in m for m in messages)
    assert not any("calibrating" in m for m in messages)
    # The same ranges quantize to the same model: identical bytes, identical outputs.
    assert given.engine_path.read_bytes() == calibrated.engine_path.read_bytes()
    np.testing.assert_array_equal(
        run(given.engine_path, given.load_options()), run(calibrated.engine_path, calibrated.load_options())
    )


def test_a_tensorrt_cache_quantizes_an_onnxruntime_build(tmp_path: Path, model: Path) -> None:
    first = builder_at(tmp_path / "first")
    calibrated = first.build(
        model,
        BuildSpec(precision="int8", device="cpu", calibration=CalibrationSource(kind="stream", frames=12)),
        calibration=frames(1),
    )
    trt_cache = Path(calibrated.effective["calibration"]["trt_cache"])
    spec = BuildSpec(
        precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", path=trt_cache)
    )
    built = builder_at(tmp_path / "second").build(model, spec)
    assert built.plan.int8_mode == "qdq"
    assert run(built.engine_path, built.load_options()).shape == (2, 4)


def test_an_unfetched_artifact_is_a_clear_build_error(tmp_path: Path, model: Path) -> None:
    spec = BuildSpec(
        precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", artifact="calibration")
    )
    with pytest.raises(BuildError, match="artifact 'calibration' was not fetched"):
        builder_at(tmp_path).build(model, spec)


def test_read_ranges_of_a_table_and_of_a_tensorrt_cache(tmp_path: Path) -> None:
    write_table(tmp_path / "t.json", {"x": (-1.0, 2.0)}, method="minmax")
    assert read_ranges(tmp_path / "t.json") == ({"x": (-1.0, 2.0)}, "minmax")
    (tmp_path / "c.cache").write_bytes(write_trt_cache({"x": 0.5}, "10.3.0"))
    ranges, method = read_ranges(tmp_path / "c.cache")
    assert method == "entropy"
    assert ranges["x"] == pytest.approx((-63.5, 63.5))
    # A table becomes a cache for the running TensorRT version; a cache passes as it is.
    assert as_trt_cache(tmp_path / "t.json", "10.3.0").startswith(b"TRT-100300-MinMaxCalibration")
    assert as_trt_cache(tmp_path / "c.cache", "8.6.1") == (tmp_path / "c.cache").read_bytes()


def test_a_file_that_is_neither_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    with pytest.raises(BuildError, match=r"labels\.txt is neither an edge-agent calibration table nor"):
        read_ranges(tmp_path / "labels.txt")


def test_calibration_source_cache_needs_a_path_or_an_artifact() -> None:
    with pytest.raises(ValueError, match="a path or an artifact"):
        CalibrationSource(kind="cache")
    with pytest.raises(ValueError, match="a path or an artifact"):
        CalibrationSource(kind="cache", path=Path("a"), artifact="b")
    with pytest.raises(ValueError, match="takes no artifact"):
        CalibrationSource(kind="stream", artifact="b")
