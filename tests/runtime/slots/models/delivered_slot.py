"""One slot that takes deployments for real: SlotModels with an engine service, behind a delivery stack.

The slot starts on classifier v1 (64 px, 10 classes); :func:`deploy_v2` deploys a v2 through the
real broker and delivery service into ``SlotModels.build_delivered`` / ``activate_delivered``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.config import SlotConfig
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.protocol.manifest import DeployManifest
from agent.runtime.slots.models.choice import SlotModels
from agent.runtime.slots.slot import ModelSlot
from agent.specs.build import BuildSpec
from agent.state.file import StateFile
from agent.telemetry import Metrics
from tests.delivery.delivery_stack import SLOT, Harness, make_keys

#: What the engine builds of these tests may take (a build child on a busy 2-core machine).
ENGINES_CONFIG = EngineConfig(build_timeout_s=120)

LatestFrame = Callable[[str], npt.NDArray[np.uint8] | None]


def slot_models(
    tmp_path: Path,
    builder: EngineBuilder,
    *,
    parallel_runs: int = 1,
    latest_frame: LatestFrame = lambda _slot: None,
    engines: EngineService | None = None,
) -> SlotModels:
    """The slot's models on classifier v1, its start-up load done (``engines``: the default service
    of ``builder`` when None)."""
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
    models = SlotModels(
        {SLOT: ModelSlot(SLOT, parallel_runs=parallel_runs)},
        {SLOT: config},
        StateFile(builder.state_dir / "state.json"),
        engines or EngineService(builder, ENGINES_CONFIG, lambda _s, _n: []),
        Metrics(),
        latest_frame=latest_frame,
        on_activated=lambda: None,
    )
    models.load_initial(SLOT, config)
    return models


def deploy_v2(
    tmp_path: Path, broker: Broker, models: SlotModels, build: BuildSpec, *, seed: int = 2, **manifest: Any
) -> tuple[Harness, DeployManifest]:
    """Start a device around ``models`` and deploy classifier v2 with ``build``; (device, manifest)."""
    device = Harness(
        broker,
        models.state_file.path.parent,
        make_keys(tmp_path / "keys"),
        build=models.build_delivered,
        activate=models.activate_delivered,
    ).start()
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=64, num_classes=10, seed=seed)
    signed = device.manifest(v2, sequence=2, build=build, **manifest)
    device.deploy(device.signed(signed))
    return device, signed
