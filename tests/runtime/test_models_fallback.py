"""A deployment whose TensorRT build fails still goes live, on ONNX Runtime, and the job says why.

TensorRT is absent here, so the planner's choice is forced with a fake platform that claims
TensorRT and a GPU (:data:`tests.engines.test_builder_fallback.FORCED_TRT`, a fake for absent
hardware). Everything else is real: the broker, the delivery service, the build children (the
TensorRT one fails for real: it cannot import TensorRT), the slot that loads and validates the
fallback engine, and state.json.
"""

from __future__ import annotations

from pathlib import Path

from agent.config import SlotConfig
from agent.engines.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.engines.spec import BuildSpec
from agent.localbroker import Broker
from agent.modelzoo import write_classifier
from agent.protocol.messages import JobState
from agent.runtime.models import SlotModels
from agent.runtime.slot import ModelSlot
from agent.state import StateFile
from agent.telemetry import Metrics
from tests.delivery.delivery_stack import SLOT, Harness, make_keys
from tests.engines.test_builder_fallback import FORCED_TRT


def _slot_models(tmp_path: Path, state_dir: Path) -> SlotModels:
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=64, num_classes=10, seed=1)
    config = SlotConfig.model_validate(
        {
            "model": v1,
            "model_id": "cls",
            "version": "1",
            "preprocess": {"width": 64, "height": 64},
            "postprocess": {"type": "classification", "top_k": 3},
        }
    )
    engines_config = EngineConfig(build_timeout_s=120)
    engines = EngineService(
        EngineBuilder(state_dir, engines_config, FORCED_TRT), engines_config, lambda _s, _n: []
    )
    models = SlotModels(
        {SLOT: ModelSlot(SLOT)},
        {SLOT: config},
        StateFile(state_dir / "state.json"),
        engines,
        Metrics(),
        latest_frame=lambda _slot: None,
        on_activated=lambda: None,
    )
    models.load_initial(SLOT, config)
    return models


def _deploy(tmp_path: Path, broker: Broker, build: BuildSpec) -> tuple[Harness, SlotModels, str]:
    state_dir = tmp_path / "state"
    models = _slot_models(tmp_path, state_dir)
    device = Harness(
        broker,
        state_dir,
        make_keys(tmp_path / "keys"),
        build=models.build_delivered,
        activate=models.activate_delivered,
    ).start()
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=64, num_classes=10, seed=2)
    manifest = device.manifest(v2, sequence=2, build=build)
    device.deploy(device.signed(manifest))
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
