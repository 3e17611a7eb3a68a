"""A deployment whose TensorRT build fails still goes live, on ONNX Runtime, and the job says why.

TensorRT is absent here, so the planner's choice is forced with a fake platform that claims
TensorRT and a GPU (:data:`tests.engines.building.test_builder_fallback.FORCED_TRT`, a fake for absent
hardware). Everything else is real: the broker, the delivery service, the build children (the
TensorRT one fails for real: it cannot import TensorRT), the slot that loads and validates the
fallback engine, and state.json.
"""

from __future__ import annotations

from pathlib import Path

from agent.demo.broker import Broker
from agent.engines.building.builder import EngineBuilder
from agent.protocol.messages import JobState
from agent.runtime.slots.models.choice import SlotModels
from agent.specs.build import BuildSpec
from tests.delivery.delivery_stack import SLOT, Harness
from tests.engines.building.test_builder_fallback import FORCED_TRT
from tests.runtime.slots.models.delivered_slot import ENGINES_CONFIG, deploy_v2, slot_models


def _deploy(tmp_path: Path, broker: Broker, build: BuildSpec) -> tuple[Harness, SlotModels, str]:
    models = slot_models(tmp_path, EngineBuilder(tmp_path / "state", ENGINES_CONFIG, FORCED_TRT))
    device, manifest = deploy_v2(tmp_path, broker, models, build)
    return device, models, manifest.job_id


def test_a_failed_tensorrt_build_ends_active_on_onnxruntime_with_the_reason(
    tmp_path: Path, broker: Broker
) -> None:
    device, models, job_id = _deploy(tmp_path, broker, BuildSpec(precision="fp16", device="gpu"))
    try:
        statuses = device.wait_terminal(job_id, timeout=120)
    finally:
        device.close()
    final = statuses[-1]
    assert final.state is JobState.ACTIVE, final
    assert final.requested is not None
    assert final.requested["device"] == "gpu"
    assert final.effective is not None
    assert final.effective["backend"] == "onnxruntime"
    assert final.effective["fallback"]["from"] == "tensorrt"
    assert "TensorRT" in final.effective["fallback"]["reason"]
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "2"
    assert current.source.backend == "onnxruntime"


def test_fallback_none_fails_the_job_naming_the_tensorrt_failure(tmp_path: Path, broker: Broker) -> None:
    spec = BuildSpec(precision="fp16", device="gpu", fallback="none")
    device, models, job_id = _deploy(tmp_path, broker, spec)
    try:
        statuses = device.wait_terminal(job_id, timeout=120)
    finally:
        device.close()
    final = statuses[-1]
    assert final.state is JobState.FAILED, final
    assert final.error_code == "build_failed"
    assert final.error is not None
    assert "fallback: none" in final.error
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "1"  # the old model keeps serving
