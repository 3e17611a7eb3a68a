"""Serve while building, in the process: a deployment that lands while the start-up engine builds wins.

Real parts: a real ONNX Runtime build in a real build child, held back by
:mod:`tests.engines.paced_build` until the test releases it; real slots and state.json.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from structlog.testing import capture_logs

from agent.config import SlotConfig
from agent.datasets.shapes import MODEL_PATH, generate
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.worker import BuildWorker
from agent.engines.service import EngineService
from agent.machine.platform import detect_platform
from agent.runtime.slots.models.choice import SlotModels
from agent.runtime.slots.models.sources import model_source
from agent.runtime.slots.slot import ModelSlot
from agent.state.file import StateFile
from agent.telemetry import Metrics
from tests.engines import paced_build
from tests.runtime.slots.models.delivered_slot import ENGINES_CONFIG
from tests.waiting import wait_until

SLOT = "cls"


def _models(tmp_path: Path, gate: Path) -> tuple[SlotModels, SlotConfig]:
    worker = BuildWorker(
        timeout_s=120, lock_path=tmp_path / "state" / "build.lock", env=paced_build.env(gate)
    )
    builder = EngineBuilder(tmp_path / "state", ENGINES_CONFIG, detect_platform(), worker=worker)
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    config = SlotConfig.model_validate(
        {
            "model": v1,
            "model_id": "cls",
            "version": "1",
            "preprocess": {"width": 32, "height": 32},
            "postprocess": {"type": "classification", "top_k": 2},
            "build": {"precision": "fp32", "device": "cpu"},
        }
    )
    models = SlotModels(
        {SLOT: ModelSlot(SLOT)},
        {SLOT: config},
        StateFile(builder.state_dir / "state.json"),
        EngineService(builder, ENGINES_CONFIG, lambda _s, _n: []),
        Metrics(),
        latest_frame=lambda _slot: None,
        on_activated=lambda: None,
    )
    return models, config


def test_a_deployment_during_the_start_up_build_is_not_overwritten_by_the_built_engine(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "release-build"
    models, config = _models(tmp_path, gate)
    models.load_initial(SLOT, config)  # returns once the interim model serves: the build is held
    slot = models.slots[SLOT]
    assert models.serving(SLOT) == "interim"
    assert slot.current is not None
    assert slot.current.source.backend == "onnxruntime"
    assert slot.current.source.build is None
    building = models.builds.info(SLOT)
    assert building is not None
    assert building["model_id"] == "cls"

    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=2)
    delivered = replace(model_source(config), path=v2, version="2")
    models.activate(SLOT, delivered, origin="delivery")
    gate.touch()
    models.join_swaps(120)

    assert slot.current is not None
    assert slot.current.ref.version == "2", "the engine built for v1 replaced the deployed v2"
    assert models.serving(SLOT) == "requested"
    assert models.builds.info(SLOT) is None
    recorded = models.state.slot(SLOT).active
    assert recorded is not None
    assert recorded.version == "2"


def test_the_built_engine_swaps_in_when_nothing_else_came(tmp_path: Path) -> None:
    gate = tmp_path / "release-build"
    models, config = _models(tmp_path, gate)
    models.load_initial(SLOT, config)
    assert models.serving(SLOT) == "interim"
    # Nothing recorded for the interim: a restart now would choose (and build) the same again.
    assert models.state.slot(SLOT).active is None
    gate.touch()
    models.join_swaps(120)
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.engine_key is not None
    assert models.serving(SLOT) == "requested"
    active = models.state.slot(SLOT).active
    assert active is not None
    assert active.engine_key == current.source.engine_key


def test_a_config_reload_giving_an_empty_slot_a_model_to_build_serves_it_while_it_builds(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "release-build"
    models, config = _models(tmp_path, gate)
    missing = config.model_copy(update={"model": tmp_path / "not-yet.onnx"})
    models.load_initial(SLOT, missing)
    slot = models.slots[SLOT]
    assert slot.current is None, "the configured model file does not exist: the slot starts empty"

    assert models.reload({SLOT: config}) == [SLOT]
    # The build is held by the gate: the slot serves its ONNX model on ONNX Runtime meanwhile.
    wait_until(lambda: models.serving(SLOT) == "interim", timeout=60, what="interim serving")
    interim = models.slots[SLOT].current
    assert interim is not None
    assert interim.source.build is None
    assert interim.source.backend == "onnxruntime"
    assert not gate.exists()
    building = models.builds.info(SLOT)
    assert building is not None
    assert building["model_id"] == "cls"

    gate.touch()
    models.join_swaps(120)
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.engine_key is not None, "the built engine swapped in"
    assert models.serving(SLOT) == "requested"


def test_a_start_up_build_calibrating_on_live_frames_logs_its_interim_serving_and_its_swap(
    tmp_path: Path,
) -> None:
    """INT8 calibrated on the slot's own frames: the ONNX model serves until the streams run, then
    the build runs and its engine swaps in, with the same two log lines as any start-up build.
    The frames come from a function standing in for the pipeline's tap (no camera here): real
    images of the shapes dataset the model reads."""
    builder = EngineBuilder(
        tmp_path / "state",
        ENGINES_CONFIG,
        detect_platform(),
        worker=BuildWorker(timeout_s=120, lock_path=tmp_path / "state" / "build.lock"),
    )
    images = list(generate(64, seed=3)[0])
    config = SlotConfig.model_validate(
        {
            "model": MODEL_PATH,
            "model_id": "cls",
            "version": "1",
            "preprocess": {"width": 64, "height": 64},
            "postprocess": {"type": "classification", "top_k": 2},
            "build": {"precision": "int8", "device": "cpu", "calibration": {"kind": "stream", "frames": 16}},
        }
    )
    models = SlotModels(
        {SLOT: ModelSlot(SLOT)},
        {SLOT: config},
        StateFile(builder.state_dir / "state.json"),
        EngineService(builder, ENGINES_CONFIG, lambda _slot, n: images[:n]),
        Metrics(),
        latest_frame=lambda _slot: images[0],
        on_activated=lambda: None,
    )
    with capture_logs() as logs:
        models.load_initial(SLOT, config)
        assert models.serving(SLOT) == "interim"
        models.start_deferred_builds()  # the streams run
        models.join_swaps(120)
    events = [e["event"] for e in logs if e["event"].startswith("slot.interim.")]
    assert events == ["slot.interim.serving", "slot.interim.swapped"], logs
    current = models.slots[SLOT].current
    assert current is not None
    assert current.source.engine_key is not None, "the built engine serves"
    assert models.serving(SLOT) == "requested"
