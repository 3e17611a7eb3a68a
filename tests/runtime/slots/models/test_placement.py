"""A delivered ``device: auto`` build on an AGX Orin goes live on the combination placement kept.

The GPU and both DLA cores are absent here: paced ONNX Runtime CPU sessions stand in for them
(:mod:`tests.engines.standin_accelerators`, a fake for that hardware only). Everything else is
real: the broker, the delivery service, the planner's candidates, the build child and engine cache,
both timing loops, the slot that loads and validates every engine of the kept set, and the job
status on the broker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.backends.base import BACKENDS
from agent.datasets.shapes import generate
from agent.demo.broker import Broker
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.protocol.messages import JobState
from agent.specs.build import BuildSpec
from tests.delivery.delivery_stack import SLOT
from tests.engines.standin_accelerators import STANDIN, STANDIN_ORIN, STANDIN_TARGET, StandInBuilder
from tests.runtime.slots.models.delivered_slot import deploy_v2, slot_models

STATIC = {"input": "images", "min": (1, 3, 64, 64), "opt": (1, 3, 64, 64), "max": (1, 3, 64, 64)}


def test_a_delivered_device_auto_build_goes_live_on_the_fastest_combination(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(BACKENDS, STANDIN, STANDIN_TARGET)
    config = EngineConfig(placement_seconds=0.6, placement_frames=8, build_timeout_s=120)
    builder = StandInBuilder(tmp_path / "state", config, STANDIN_ORIN)
    images, _ = generate(8, seed=9, size=64)
    engines = EngineService(builder, config, lambda _slot, n: list(images[:n]))
    models = slot_models(tmp_path, builder, parallel_runs=3, engines=engines)
    build = BuildSpec.model_validate({"precision": "fp16", "device": "auto", "profiles": [STATIC]})

    device, manifest = deploy_v2(tmp_path, broker, models, build)
    try:
        final = device.wait_terminal(manifest.job_id, timeout=120)[-1]
    finally:
        device.close()

    assert final.state is JobState.ACTIVE, final
    assert final.effective is not None
    assert final.effective["requested"]["device"] == "auto"
    choice = final.effective["placement_choice"]
    # Which set is fastest is measured (the stand-ins are paced, but a loaded host slows some runs):
    # the kept set is the fastest of the report's own figures, whichever it was.
    fastest = max(choice["combinations"], key=lambda o: o["fps"])
    assert choice["combined_fps"] == fastest["fps"]
    assert sorted(choice["chosen"]) == sorted(fastest["devices"])
    assert len(choice["combinations"]) == 6, "three alone, three sets together"
    # The job status reports each engine of the kept set, as for a build.devices set.
    assert [e["device"] for e in final.effective["engines"]] == choice["chosen"]

    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.version == "2"
    assert len(current.engines) == len(choice["chosen"])
    assert all(e.runner.backend == STANDIN for e in current.engines)
    # The set runs in the order placement kept it (best solo first), each engine on its device.
    assert [row["device"] for row in current.engine_shares()] == choice["chosen"]
