"""A deployment whose build asks for several devices (``build.devices``) goes live on all of them.

Three ONNX Runtime CPU sessions (``devices: [cpu, cpu, cpu]``) stand in for the DLA0, DLA1 and GPU
engines a Jetson would build: no machine here has them. Everything else is real: the broker, the
delivery service, the build child, the engine cache, the slot that loads and validates every engine
of the set, and state.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent.demo.broker import Broker
from agent.engines.building.builder import EngineBuilder
from agent.machine.platform import detect_platform
from agent.protocol.messages import JobState
from agent.runtime.slots.models.choice import SlotModels
from agent.specs.build import BuildSpec
from tests.delivery.delivery_stack import SLOT
from tests.runtime.slots.models.delivered_slot import ENGINES_CONFIG, deploy_v2, slot_models


def _slot_models(tmp_path: Path, state_dir: Path) -> SlotModels:
    builder = EngineBuilder(state_dir, ENGINES_CONFIG, detect_platform())
    return slot_models(tmp_path, builder, parallel_runs=3)


def test_a_delivered_build_devices_set_ends_active_with_three_engines_recorded(
    tmp_path: Path, broker: Broker
) -> None:
    """devices [cpu, cpu, cpu]: CPU sessions standing in for dla0, dla1 and gpu."""
    state_dir = tmp_path / "state"
    models = _slot_models(tmp_path, state_dir)
    build = BuildSpec.model_validate({"precision": "fp32", "devices": ["cpu", "cpu", "cpu"]})
    device, manifest = deploy_v2(tmp_path, broker, models, build)
    try:
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
