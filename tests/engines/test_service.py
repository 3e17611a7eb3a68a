"""EngineService: INT8 calibrated on a slot's frames goes live only past the accuracy guard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt

from agent.datasets.shapes import generate
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.progress import frames_of
from agent.engines.service import EngineService, FrameSource
from agent.engines.settings import EngineConfig
from agent.machine.platform import detect_platform
from agent.protocol.runs import runs_of
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec

MODEL = Path(__file__).resolve().parents[2] / "agent" / "assets" / "shapes_classifier.onnx"
SPEC = BuildSpec.model_validate(
    {"precision": "int8", "device": "cpu", "calibration": {"kind": "stream", "frames": 32}}
)


class SlotFrames:
    """Frames a slot 'captures': calibration takes ``calibration`` (in parts), the guard what follows."""

    def __init__(self, calibration: npt.NDArray[np.uint8]) -> None:
        self.calls: list[int] = []
        self.calibration = calibration
        self._given = 0

    def __call__(self, slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        self.calls.append(n)
        if self._given < len(self.calibration):
            part = list(self.calibration[self._given : self._given + n])
            self._given += len(part)
            return part
        images, _ = generate(n, seed=4242, size=64)
        return list(images)


def _service(tmp_path: Path, frames: FrameSource) -> EngineService:
    config = EngineConfig(int8_agreement=0.9, guard_frames=48)
    return EngineService(EngineBuilder(tmp_path, config, detect_platform()), config, frames)


def test_good_calibration_goes_live_as_int8(tmp_path: Path) -> None:
    images, _ = generate(32, seed=7, size=64)
    frames = SlotFrames(images)
    said: list[str] = []
    prepared = _service(tmp_path, frames).prepare(
        "cls", MODEL, SPEC, PreprocessSpec(width=64, height=64), progress=said.append
    )
    assert frames.calls == [2] * 16 + [48]  # calibration in parts of a twentieth, then the guard
    collected = [frames_of(line) for line in said if line.startswith("calibration: collected")]
    assert collected == [(2 * n, 32) for n in range(1, 17)]
    assert prepared.artifact.plan.precision == "int8"
    assert prepared.effective["int8_guard"]["passed"] is True
    assert prepared.effective["int8_guard"]["agreement"] >= 0.9


def test_degenerate_calibration_is_refused_and_falls_back(tmp_path: Path) -> None:
    """Calibrated on black frames, INT8 saturates on real scenes: the guard refuses it, FP16/FP32 serves."""
    black = np.zeros((32, 64, 64, 3), np.uint8)
    prepared = _service(tmp_path, SlotFrames(black)).prepare(
        "cls", MODEL, SPEC, PreprocessSpec(width=64, height=64)
    )
    guard = prepared.effective["int8_guard"]
    assert guard["passed"] is False
    assert "below the required" in guard["reason"]
    assert prepared.artifact.plan.precision != "int8"
    assert "fallback_reason" in prepared.effective
    # The job reports what the operator asked for, not the FP16 request of the rebuild.
    assert prepared.effective["requested"]["precision"] == "int8"
    runs = runs_of(prepared.effective)
    assert (runs.requested, runs.precision, runs.source) == ("int8", "fp32", "built")
    assert runs.fallback is not None
    assert runs.fallback.startswith("INT8 accuracy guard: INT8 top-1 agrees with FP32 on ")
    assert runs.fallback.endswith("; ONNX Runtime runs FP32 on the CPU")


def test_a_set_of_devices_gives_one_engine_each_with_its_reason(tmp_path: Path) -> None:
    """build.devices [dla0, dla1, gpu] here (no DLA, no GPU): each is planned apart onto the CPU,
    says why, and the set has three engines (ONNX Runtime CPU sessions stand in for the devices)."""
    spec = BuildSpec.model_validate({"precision": "fp16", "devices": ["dla0", "dla1", "gpu"]})
    service = _service(tmp_path, SlotFrames(np.zeros((1, 64, 64, 3), np.uint8)))
    prepared = service.prepare_set("cls", MODEL, spec, PreprocessSpec(width=64, height=64))
    assert [p.effective["engine_device"] for p in prepared] == ["dla0", "dla1", "gpu"]
    assert [p.effective["device"] for p in prepared] == ["cpu", "cpu", "cpu"]
    assert all(p.effective["engine_reason"] == "listed in build.devices" for p in prepared)
    assert [p.effective["requested"]["device"] for p in prepared] == ["dla0", "dla1", "gpu"]
    # The same plan here, so the same cache entry: built once, then found.
    assert [p.artifact.cache_hit for p in prepared] == [False, True, True]


def test_no_devices_prepares_one_engine(tmp_path: Path) -> None:
    service = _service(tmp_path, SlotFrames(np.zeros((1, 64, 64, 3), np.uint8)))
    prepared = service.prepare_set("cls", MODEL, BuildSpec(device="cpu"), PreprocessSpec(width=64, height=64))
    assert len(prepared) == 1
    assert "engine_device" not in prepared[0].effective


class SteadyFrames:
    """A slot whose calibration frames are the same at every build (as a calibration file is), and
    whose guard frames are counted: a second check of one engine shows as a second guard call."""

    def __init__(self, calibration: npt.NDArray[np.uint8], guard_frames: int) -> None:
        self.calibration = calibration
        self.guard_frames = guard_frames
        self.guard_calls = 0

    def __call__(self, slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        if n == self.guard_frames:
            self.guard_calls += 1
            images, _ = generate(n, seed=4242, size=64)
            return list(images)
        return list(self.calibration[:n])


def test_an_int8_engine_checked_once_is_not_checked_again_its_verdict_kept_across_a_restart(
    tmp_path: Path,
) -> None:
    """A rollback to a model whose INT8 engine the guard rejected takes the known verdict and the
    FP16 engine at once: the check ran for seconds (13 s on a Jetson) past a command's timeout."""
    frames = SteadyFrames(np.zeros((32, 64, 64, 3), np.uint8), guard_frames=48)
    preprocess = PreprocessSpec(width=64, height=64)
    first = _service(tmp_path, frames).prepare("cls", MODEL, SPEC, preprocess)
    assert frames.guard_calls == 1
    assert first.effective["int8_guard"]["passed"] is False
    again = _service(tmp_path, frames).prepare("cls", MODEL, SPEC, preprocess)  # a new process: a restart
    assert frames.guard_calls == 1
    assert again.artifact.key == first.artifact.key  # the same FP16 engine, from the cache
    assert again.effective["int8_guard"] == first.effective["int8_guard"]
    assert again.effective["fallback_reason"] == first.effective["fallback_reason"]
    # Another bar (engines.int8_agreement changed) judges the kept figures again, without a check.
    strict = EngineConfig(int8_agreement=0.0, guard_frames=48)
    relaxed = EngineService(EngineBuilder(tmp_path, strict, detect_platform()), strict, frames)
    assert relaxed.prepare("cls", MODEL, SPEC, preprocess).effective["int8_guard"]["passed"] is True
    assert frames.guard_calls == 1
