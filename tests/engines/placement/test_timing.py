"""The placement timing loop, run for real on ONNX Runtime (CPU) engines built by the real builder.

No GPU or DLA here: ONNX Runtime CPU sessions (FP32 and INT8 Q/DQ engines) stand in for the
candidate devices, so the loops, the builds and the choice run end to end; no speed figure is asserted.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from agent.backends.base import Feeds, LoadOptions, Outputs, Runner, get_backend
from agent.datasets.shapes import generate
from agent.engines.building.builder import EngineBuilder
from agent.engines.calibration.store import collect_frames
from agent.engines.placement.choice import choose_placement
from agent.engines.placement.timing import time_runner, time_together
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.errors import BuildError
from agent.machine.platform import detect_platform
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec
from tests.engines.building.test_builder_fallback import FORCED_TRT

MODEL = Path(__file__).resolve().parents[3] / "agent" / "assets" / "shapes_classifier.onnx"
PRE = PreprocessSpec(width=64, height=64)


def _frames(n: int = 8) -> list[np.ndarray]:
    images, _ = generate(n, seed=5, size=64)
    return collect_frames(list(images), n, PRE, batch_size=1)


def test_time_runner_times_a_real_engine_for_the_given_time() -> None:
    runner = get_backend("onnxruntime").load(MODEL, LoadOptions())
    try:
        timing = time_runner(runner, _frames(), seconds=0.3)
    finally:
        runner.close()
    assert timing.seconds >= 0.3
    assert timing.frames >= 5
    assert timing.fps == pytest.approx(timing.frames / timing.seconds)
    assert 0 < timing.p50_ms <= timing.p95_ms


def test_time_runner_stops_when_cancelled_and_refuses_no_frames() -> None:
    runner = get_backend("onnxruntime").load(MODEL, LoadOptions())
    cancel = threading.Event()
    cancel.set()
    try:
        with pytest.raises(BuildError, match="cancelled"):
            time_runner(runner, _frames(), seconds=30.0, cancel=cancel)
        with pytest.raises(BuildError, match="no frames"):
            time_runner(runner, [], seconds=0.1)
    finally:
        runner.close()


def _cpu_sessions(n: int) -> list[Runner]:
    """``n`` ONNX Runtime CPU sessions of one model, standing in for the engines of several devices."""
    return [get_backend("onnxruntime").load(MODEL, LoadOptions(intra_op_threads=1)) for _ in range(n)]


def test_time_together_runs_every_engine_from_one_queue_and_counts_each_frame_once() -> None:
    """Three CPU sessions stand in for a GPU and two DLA engines (absent here)."""
    runners = _cpu_sessions(3)
    try:
        timing = time_together(runners, _frames(), seconds=0.5)
    finally:
        for runner in runners:
            runner.close()
    assert len(timing.engine_frames) == 3
    assert timing.frames == sum(timing.engine_frames)
    assert all(n > 0 for n in timing.engine_frames), timing  # every worker took frames off the queue
    assert timing.seconds >= 0.5
    assert timing.fps == pytest.approx(timing.frames / timing.seconds)


def test_time_together_runs_at_least_min_calls_and_one_engine_alone() -> None:
    (runner,) = _cpu_sessions(1)
    try:
        timing = time_together([runner], _frames(), seconds=0.0, min_calls=7)
    finally:
        runner.close()
    assert timing.engine_frames == (7,)


class _FailsAfter(Runner):
    """A real CPU session that raises on its ``n``-th call: an engine failing mid-timing."""

    def __init__(self, inner: Runner, n: int) -> None:
        super().__init__(inner.inputs, inner.outputs)
        self.inner, self.left = inner, n

    def _infer(self, feeds: Feeds) -> Outputs:
        self.left -= 1
        if self.left <= 0:
            raise RuntimeError("device lost")
        return self.inner.infer(feeds)


def test_time_together_fails_naming_the_engine_and_stops_when_cancelled() -> None:
    good, bad = _cpu_sessions(2)
    try:
        with pytest.raises(BuildError, match="engine 1 failed while being timed together: device lost"):
            time_together([good, _FailsAfter(bad, 10)], _frames(), seconds=30.0)
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(BuildError, match="cancelled"):
            time_together([good, bad], _frames(), seconds=30.0, cancel=cancel)
        with pytest.raises(BuildError, match="no engines"):
            time_together([], _frames(), seconds=0.1)
        with pytest.raises(BuildError, match="no frames"):
            time_together([good], [], seconds=0.1)
    finally:
        good.close()
        bad.close()


def _service(tmp_path: Path, platform_facts: object = None) -> EngineService:
    config = EngineConfig(placement_seconds=0.3, placement_frames=8, build_timeout_s=120)
    images, _ = generate(8, seed=9, size=64)
    platform = detect_platform() if platform_facts is None else platform_facts
    builder = EngineBuilder(tmp_path / "state", config, platform)  # type: ignore[arg-type]
    return EngineService(builder, config, lambda _slot, n: list(images[:n]))


@pytest.mark.slow
def test_measure_candidates_builds_and_times_each_for_real(tmp_path: Path) -> None:
    service = _service(tmp_path)
    calibration = _frames(16)
    specs = {
        "cpu-fp32": BuildSpec(precision="fp32", device="cpu"),
        "cpu-int8": BuildSpec.model_validate(
            {"precision": "int8", "device": "cpu", "calibration": {"kind": "stream", "frames": 16}}
        ),
    }
    built, timed, failed = service.measure_candidates(
        MODEL, specs, _frames(), calibration=calibration, preprocess=PRE
    )
    assert failed == {}
    assert set(built) == {"cpu-fp32", "cpu-int8"}
    assert [t.device for t in timed] == ["cpu-fp32", "cpu-int8"]
    assert all(t.fps > 0 and t.frames >= 5 for t in timed)
    choice = choose_placement(timed, "throughput", dla_max_slowdown=2.0)
    assert choice.devices[0] in {"cpu-fp32", "cpu-int8"}


@pytest.mark.slow
def test_auto_on_an_orin_times_gpu_and_both_dlas_and_reports_why_none_could_run(tmp_path: Path) -> None:
    """The fake Orin (TensorRT claimed, absent here) gives three candidates; each TensorRT build fails
    for real, so the planner's choice is built (and falls back to ONNX Runtime), and the job's
    effective says what was tried."""
    from dataclasses import replace

    service = _service(tmp_path, replace(FORCED_TRT, dla_cores=2))
    static = {"input": "images", "min": (1, 3, 64, 64), "opt": (1, 3, 64, 64), "max": (1, 3, 64, 64)}
    spec = BuildSpec.model_validate({"precision": "fp16", "device": "auto", "profiles": [static]})
    prepared = service.prepare("cls", MODEL, spec, PRE)
    choice = prepared.effective["placement_choice"]
    assert choice["candidates"] == ["gpu", "dla0", "dla1"]
    assert set(choice["failed"]) == {"gpu", "dla0", "dla1"}
    assert "no candidate could be built" in choice["reason"]
    assert prepared.effective["requested"]["device"] == "auto"
    assert prepared.artifact.backend == "onnxruntime"
    assert prepared.effective["fallback"]["from"] == "tensorrt"


def test_auto_with_one_candidate_measures_nothing(tmp_path: Path) -> None:
    prepared = _service(tmp_path).prepare("cls", MODEL, BuildSpec(precision="fp32", device="auto"), PRE)
    assert "placement_choice" not in prepared.effective
