"""A TensorRT engine that builds but fails to load or validate falls back to ONNX Runtime too.

TensorRT is absent here, so two stand-ins for absent hardware force the TensorRT path:
:data:`~tests.engines.building.test_builder_fallback.FORCED_TRT` (a platform that claims TensorRT and a GPU,
so the planner picks TensorRT) and :class:`PlanFakingWorker` (a "TensorRT build" that writes bytes
that are no plan). Everything after that is real: the agent's TensorRT backend fails to load that
file (TensorRT cannot be imported), the slot rejects it, the ONNX Runtime fallback is a real build in
the build child, the slot loads and validates it (and runs the shadow on real frames), the broker,
the delivery service and state.json.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np

from agent.demo.broker import Broker
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.fallback import FAILED_AT
from agent.engines.building.worker import BuildWorker
from agent.engines.job import BuildJob, Progress, WorkerResult
from agent.protocol.messages import JobState, JobStatus
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.runtime.slots.models.choice import SlotModels
from agent.specs.build import BuildSpec
from tests.delivery.delivery_stack import SLOT, Harness, states
from tests.engines.building.test_builder_fallback import FORCED_TRT
from tests.engines.failing_jobs import TEST_ENV
from tests.runtime.slots.models.delivered_slot import ENGINES_CONFIG, deploy_v2, slot_models

#: What the fake plan holds: readable by a human who finds it in the engine cache.
FAKE_PLAN = b"not a TensorRT plan: written by PlanFakingWorker, a test stand-in for absent TensorRT\n"


class PlanFakingWorker(BuildWorker):
    """A fake for absent hardware: a TensorRT job "succeeds" by writing :data:`FAKE_PLAN` as its
    engine (no TensorRT here to build a real one); every other job runs for real in the build child."""

    def __init__(self, lock_path: Path, *, crash_ort: bool = False) -> None:
        super().__init__(timeout_s=120, lock_path=lock_path, env=TEST_ENV)
        self.trt_jobs = 0
        #: Run ONNX Runtime jobs as the test-only 'crash' kind (a real child that segfaults).
        self.crash_ort = crash_ort

    def run(
        self, job: BuildJob, progress: Progress | None = None, cancel: threading.Event | None = None
    ) -> WorkerResult:
        if job.kind != "tensorrt":
            crash = self.crash_ort and job.kind == "onnxruntime"
            return super().run(job.model_copy(update={"kind": "crash"}) if crash else job, progress, cancel)
        self.trt_jobs += 1
        job.out_dir.mkdir(parents=True, exist_ok=True)
        (job.out_dir / job.engine_file).write_bytes(FAKE_PLAN)
        return WorkerResult(engine_file=job.engine_file, report={"fake": "TensorRT absent"})


def _deploy(
    tmp_path: Path,
    broker: Broker,
    build: BuildSpec,
    *,
    v2_seed: int = 2,
    crash_ort: bool = False,
    **manifest: Any,
) -> tuple[Harness, SlotModels, str, PlanFakingWorker]:
    state_dir = tmp_path / "state"
    worker = PlanFakingWorker(state_dir / "build.lock", crash_ort=crash_ort)
    builder = EngineBuilder(state_dir, ENGINES_CONFIG, FORCED_TRT, worker=worker)
    # Camera-like frames for validation and the shadow: a gradient that moves one pixel per call, each
    # call a new frame (the shadow compares only frames it has not seen).
    gradient = np.tile(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], (64, 1, 3))
    shift = itertools.count()

    def latest_frame(_slot: str) -> np.ndarray[tuple[int, ...], np.dtype[np.uint8]]:
        return np.roll(gradient, next(shift), axis=1)

    models = slot_models(tmp_path, builder, latest_frame=latest_frame)
    device, signed = deploy_v2(tmp_path, broker, models, build, seed=v2_seed, **manifest)
    return device, models, signed.job_id, worker


def _final(device: Harness, job_id: str) -> list[JobStatus]:
    try:
        return device.wait_terminal(job_id, timeout=120)
    finally:
        device.close()


def _assert_active_on_onnxruntime(final: JobStatus, models: SlotModels) -> None:
    assert final.state is JobState.ACTIVE, final
    assert final.effective is not None
    assert final.effective["backend"] == "onnxruntime"
    fallback = final.effective["fallback"]
    assert (fallback["from"], fallback["to"], fallback["stage"]) == ("tensorrt", "onnxruntime", "load")
    assert "tensorrt" in fallback["reason"].lower()  # the backend's own load error
    changes = final.effective.get("changes") or []
    assert any(FAILED_AT["load"] in str(c.get("reason")) for c in changes), changes
    current = models.slots[SLOT].current
    assert current is not None
    assert (current.source.version, current.source.backend) == ("2", "onnxruntime")
    saved = models.state.slot(SLOT).active
    assert saved is not None
    assert (saved.version, saved.backend) == ("2", "onnxruntime")


def test_a_tensorrt_engine_that_fails_to_load_ends_active_on_onnxruntime_with_the_reason(
    tmp_path: Path, broker: Broker
) -> None:
    device, models, job_id, worker = _deploy(tmp_path, broker, BuildSpec(precision="fp16", device="gpu"))
    final = _final(device, job_id)[-1]
    assert worker.trt_jobs == 1  # the TensorRT "build" succeeded; its engine then failed to load
    _assert_active_on_onnxruntime(final, models)


def test_fallback_none_rolls_back_naming_the_tensorrt_load_failure(tmp_path: Path, broker: Broker) -> None:
    spec = BuildSpec(precision="fp16", device="gpu", fallback="none")
    device, models, job_id, _ = _deploy(tmp_path, broker, spec)
    final = _final(device, job_id)[-1]
    assert final.state is JobState.ROLLED_BACK, final
    assert final.error is not None
    assert FAILED_AT["load"] in final.error
    assert "fallback: none" in final.error
    assert final.effective is not None
    assert final.effective["backend"] == "tensorrt"  # what was built, and failed
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "1"  # the old model keeps serving


def test_a_fallback_that_fails_too_rolls_back_naming_both_failures(tmp_path: Path, broker: Broker) -> None:
    spec = BuildSpec(precision="fp16", device="gpu")
    device, models, job_id, _ = _deploy(tmp_path, broker, spec, crash_ort=True)
    final = _final(device, job_id)[-1]
    assert final.state is JobState.ROLLED_BACK, final
    assert final.error is not None
    assert FAILED_AT["load"] in final.error
    assert "TensorRT is not installed" in final.error
    assert "the ONNX Runtime fallback failed too" in final.error
    assert "SIGSEGV" in final.error
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "1"


def test_a_fallen_back_engine_goes_through_shadow_and_probation_to_active(
    tmp_path: Path, broker: Broker
) -> None:
    # v2 has v1's weights, so the shadow agrees on the frame: the guard phases pass on their merits.
    device, models, job_id, _ = _deploy(
        tmp_path,
        broker,
        BuildSpec(precision="fp16", device="gpu"),
        v2_seed=1,
        shadow=ShadowSpec(frames=5, sample_fps=20.0, timeout_s=30),
        probation_s=1.0,
        probation=ProbationSpec(),
    )
    statuses = _final(device, job_id)
    assert states(statuses)[-4:] == [
        JobState.VALIDATING,
        JobState.SHADOW,
        JobState.PROBATION,
        JobState.ACTIVE,
    ]
    final = statuses[-1]
    _assert_active_on_onnxruntime(final, models)
    assert final.shadow is not None
    assert final.shadow.frames >= 5
    assert final.probation is not None
    # Every status from the fallback on says what the slot runs: the shadow and probation ones too.
    guarded = [s for s in statuses if s.state in {JobState.SHADOW, JobState.PROBATION}]
    assert guarded
    assert all(s.effective is not None and s.effective["backend"] == "onnxruntime" for s in guarded)
