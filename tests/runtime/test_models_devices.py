"""A deployment whose build asks for several devices (``build.devices``) goes live on all of them.

Three ONNX Runtime CPU sessions (``devices: [cpu, cpu, cpu]``) stand in for the DLA0, DLA1 and GPU
engines a Jetson would build: no machine here has them. Everything else is real: the broker, the
delivery service, the build child, the engine cache, the slot that loads and validates every engine
of the set, and state.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent.config import SlotConfig
from agent.engines.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.engines.spec import BuildSpec
from agent.localbroker import Broker
from agent.modelzoo import write_classifier
from agent.platform import detect_platform
from agent.protocol.messages import JobState
from agent.runtime.models import SlotModels
from agent.runtime.slot import ModelSlot
from agent.state import StateFile
from agent.telemetry import Metrics
from tests.delivery.delivery_stack import SLOT, Harness, make_keys


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
        EngineBuilder(state_dir, engines_config, detect_platform()), engines_config, lambda _s, _n: []
    )
    models = SlotModels(
        {SLOT: ModelSlot(SLOT, parallel_runs=3)},
        {SLOT: config},
        StateFile(state_dir / "state.json"),
        engines,
        Metrics(),
        latest_frame=lambda _slot: None,
        on_activated=lambda: None,
    )
    models.load_initial(SLOT, config)
    return models


def test_a_delivered_build_devices_set_ends_active_with_three_engines_recorded(
    tmp_path: Path, broker: Broker
) -> None:
    """devices [cpu, cpu, cpu]: CPU sessions standing in for dla0, dla1 and gpu."""
    state_dir = tmp_path / "state"
    models = _slot_models(tmp_path, state_dir)
    device = Harness(
        broker,
        state_dir,
        make_keys(tmp_path / "keys"),
        build=models.build_delivered,
        activate=models.activate_delivered,
    ).start()
    try:
        v2 = write_classifier(tmp_path / "v2.onnx", input_size=64, num_classes=10, seed=2)
        build = BuildSpec.model_validate({"precision": "fp32", "devices": ["cpu", "cpu", "cpu"]})
        manifest = device.manifest(v2, sequence=2, build=build)
        device.deploy(device.signed(manifest))
        final = device.wait_terminal(manifest.job_id, timeout=120)[-1]
    finally:
        device.close()

    assert final.state is JobState.ACTIVE, final
    assert final.effective is not None
    engines = final.effective["engines"]
    assert len(engines) == 3, engines
    assert [e["device"] for e in engines] == ["cpu", "cpu", "cpu"]
    assert all(e["reason"] == "listed in build.devices" for e in engines), engines

    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "2"
    assert len(current.engines) == 3
    assert len({id(e.runner) for e in current.engines}) == 3, "each engine is its own session"

    # state.json (on disk, not only in memory) records the delivered model and its build request.
    saved = json.loads((state_dir / "state.json").read_text())["slots"][SLOT]["active"]
    assert (saved["version"], saved["origin"], saved["sha256"]) == ("2", "delivery", manifest.sha256)
    assert saved["engine_key"] is not None
    assert saved["build"]["devices"] == ["cpu", "cpu", "cpu"]

    # A restart comes back on the delivered set, every engine of it (from the engine cache).
    restarted = _slot_models(tmp_path, state_dir).slots[SLOT].current
    assert restarted is not None
    assert (restarted.source.version, len(restarted.engines)) == ("2", 3)
