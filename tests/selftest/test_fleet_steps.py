"""The self-test's fleet step: skipped here (no TensorRT engine), and its mechanics shown on this
machine's ONNX Runtime engine: offered, signed, downloaded onto a second cache, loaded, same outputs."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from agent.engines.building.builder import EngineBuilder
from agent.engines.settings import EngineConfig
from agent.machine.platform import BackendAvailability, Platform
from agent.selftest.fleet_steps import downloaded_engine_step, shared_and_loaded
from agent.selftest.run import QUICK, SelfTestRun
from agent.selftest.step import Skipped
from agent.specs.build import BuildSpec

PLATFORM = Platform(
    machine="x86_64",
    onnxruntime_version=ort.__version__,
    ort_providers=("CPUExecutionProvider",),
    backends={
        "onnxruntime": BackendAvailability(True, "onnxruntime"),
        "tensorrt": BackendAvailability(False, "TensorRT is not installed"),
    },
)


@pytest.fixture
def run(tmp_path: Path) -> SelfTestRun:
    builder = EngineBuilder(tmp_path / "state", EngineConfig(), PLATFORM)
    return SelfTestRun(platform=PLATFORM, builder=builder, work_dir=tmp_path / "work", sizes=QUICK)


def test_without_tensorrt_the_step_is_skipped_with_the_reason(run: SelfTestRun) -> None:
    with pytest.raises(Skipped, match="TensorRT"):
        downloaded_engine_step(run)


def test_an_engine_shared_through_the_desk_loads_on_a_second_cache_with_the_same_outputs(
    run: SelfTestRun,
) -> None:
    spec = BuildSpec(precision="fp32", device="cpu")
    first = run.builder.build(run.model, spec)
    passed = shared_and_loaded(run, first, spec)
    assert passed.data["max_abs_diff"] == 0.0
    assert passed.data["key"] == first.key
