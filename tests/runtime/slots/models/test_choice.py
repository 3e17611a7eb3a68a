"""SlotModels: one owner per slot. Real ONNX models, real ModelSlot, real state.json; no stand-ins."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.config import SlotConfig
from agent.delivery.commands import Followed
from agent.delivery.jobs.steps import ActivationRequest
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.errors import DiskFullError
from agent.fsutil import sha256_file
from agent.machine.platform import detect_platform
from agent.runtime.slots.models.choice import SlotModels
from agent.runtime.slots.models.rollback import NoRollbackTargetError, SlotRollback
from agent.runtime.slots.models.sources import model_source
from agent.runtime.slots.slot import ModelSlot
from agent.state.file import AgentState, ModelRecord, StateFile, record_activation
from agent.telemetry import Metrics
from tests.small_disk import small_disk
from tests.waiting import patient


def _config(model: Path, version: str = "1") -> SlotConfig:
    return SlotConfig.model_validate(
        {
            "model": model,
            "model_id": "cls",
            "version": version,
            "preprocess": {"width": 32, "height": 32},
            "postprocess": {"type": "classification", "top_k": 2},
        }
    )


def _slot_models(tmp_path: Path, config: SlotConfig, state_file: StateFile) -> SlotModels:
    engines = EngineService(
        EngineBuilder(tmp_path / "engines", EngineConfig(), detect_platform()),
        EngineConfig(),
        lambda _s, _n: [],
    )
    return SlotModels(
        {"cls": ModelSlot("cls")},
        {"cls": config},
        state_file,
        engines,
        Metrics(),
        latest_frame=lambda _slot: None,
        on_activated=lambda: None,
    )


def _request(model: Path, version: str) -> ActivationRequest:
    return ActivationRequest(
        slot="cls",
        engine_path=model,
        backend="onnxruntime",
        load_extra={},
        model_id="cls",
        version=version,
        sha256=sha256_file(model),
        model_path=model,
    )


def test_a_deployment_waits_for_the_slots_start_up_load_and_then_wins(tmp_path: Path) -> None:
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=2)
    config = _config(v1)
    state_file = StateFile(tmp_path / "state" / "state.json")
    models = _slot_models(tmp_path, config, state_file)
    slot = models.slots["cls"]
    request = _request(v2, "2")
    # A resumed deployment's retained manifest arrives while the agent has not loaded the slot yet.
    activated = threading.Event()

    def deploy() -> None:
        models.activate_delivered(request)
        activated.set()

    deployment = threading.Thread(target=deploy)
    deployment.start()
    try:
        assert not activated.wait(0.5), "the deployment activated before the slot's start-up load"
        assert models.slots["cls"].current is None
        models.load_initial("cls", config)
        assert activated.wait(patient(20))
    finally:
        deployment.join(patient(20))
    current = slot.current
    assert current is not None
    assert current.ref.sha256 == sha256_file(v2)
    saved = state_file.load().slot("cls")
    assert saved.active is not None
    assert saved.last_known_good is not None
    assert (saved.active.sha256, saved.active.origin) == (sha256_file(v2), "delivery")
    assert saved.last_known_good.sha256 == sha256_file(v1)
    slot.close()


def test_the_same_bytes_deployed_as_a_new_version_can_be_rolled_back_to_the_old_one(tmp_path: Path) -> None:
    """Issue 20.13: v1 runs, its very bytes are deployed as version 2; ``rollback`` brings back v1."""
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    config = _config(v1)
    state_file = StateFile(tmp_path / "state" / "state.json")
    models = _slot_models(tmp_path, config, state_file)
    slot = models.slots["cls"]
    models.load_initial("cls", config)
    stored = tmp_path / "models" / f"{sha256_file(v1)}.onnx"  # where delivery stores the same bytes
    stored.parent.mkdir()
    stored.write_bytes(v1.read_bytes())
    request = _request(stored, "2")
    models.activate_delivered(request)
    current = slot.current
    assert current is not None
    assert current.ref.version == "2"

    reply = models.rollback("cls")

    assert isinstance(reply, dict)  # over within the reply window: the result itself
    assert reply["model"]["version"] == "1"
    current = slot.current
    assert current is not None
    assert current.ref.version == "1"
    saved = state_file.load().slot("cls")
    assert saved.active is not None
    assert (saved.active.version, saved.active.origin) == ("1", "rollback")


def test_on_a_full_state_disk_a_deployment_or_rollback_changes_nothing_and_a_start_still_serves(
    tmp_path: Path,
) -> None:
    """Issue 19.8: what serves is what state.json says, so what a restart brings back. A deployment or
    a rollback the full disk cannot record leaves the model serving that state.json names; a start
    on the full disk still serves (and chooses what the previous start chose)."""
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=2)
    v3 = write_classifier(tmp_path / "v3.onnx", input_size=32, num_classes=4, seed=3)
    config = _config(v1)

    def serving(models: SlotModels) -> str | None:
        current = models.slots["cls"].current
        assert current is not None
        return current.ref.version

    with small_disk(tmp_path / "state", "1m") as disk:
        state_file = StateFile(disk.path / "state.json")
        models = _slot_models(tmp_path, config, state_file)
        models.load_initial("cls", config)
        models.activate_delivered(_request(v2, "2"))
        disk.fill()

        with pytest.raises(OSError) as raised:
            models.activate_delivered(_request(v3, "3"))
        assert raised.value.errno == errno.ENOSPC
        assert serving(models) == "2"
        assert models.slots["cls"].state.value == "active"
        with pytest.raises(DiskFullError, match=r"cls 2 keeps serving"):
            models.rollback("cls")
        assert serving(models) == "2"
        for state in (state_file.load(), models.state):
            active = state.slot("cls").active
            assert active is not None
            assert active.version == "2"

        restarted = _slot_models(tmp_path, config, state_file)  # a restart on the still-full disk
        restarted.load_initial("cls", config)
        assert serving(restarted) == "2"


class _HeldStateFile(StateFile):
    """A real state.json whose next save waits until the test lets it go: it holds a config swap
    between serving its model and recording it, the window a rollback once fell into."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def save(self, state: AgentState) -> None:
        if self.hold.is_set():
            self.hold.clear()
            self.holding.set()
            assert self.release.wait(patient(30)), "the test never let the save go"
        super().save(state)


def test_a_rollback_sent_while_a_config_swap_records_its_model_waits_and_rolls_back(tmp_path: Path) -> None:
    """A config reload serves its model first and records it after; a rollback that reads state.json
    between the two found no last-known-good and was refused (CI, 2026-11-25). It waits now."""
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=2)
    state_file = _HeldStateFile(tmp_path / "state" / "state.json")
    models = _slot_models(tmp_path, _config(v1), state_file)
    models.load_initial("cls", _config(v1))
    state_file.hold.set()
    models.start_swap("cls", model_source(_config(v2, "2")), None)
    assert state_file.holding.wait(patient(20)), "the swap never came to record its model"
    current = models.slots["cls"].current
    assert current is not None
    assert current.ref.version == "2"  # v2 serves, state.json does not say so yet

    replies: list[dict[str, Any] | Followed] = []
    rollback = threading.Thread(target=lambda: replies.append(models.rollback("cls")))
    rollback.start()
    rollback.join(0.5)
    assert rollback.is_alive(), "the rollback answered before the swap it follows was recorded"
    state_file.release.set()
    rollback.join(patient(20))

    assert [r["model"]["version"] for r in replies if isinstance(r, dict)] == ["1"]
    saved = state_file.load().slot("cls")
    assert saved.active is not None
    assert (saved.active.version, saved.active.origin) == ("1", "rollback")


def test_the_calibration_an_active_or_last_known_good_engine_was_built_with_is_protected(
    tmp_path: Path,
) -> None:
    """The artifact cleanup keeps what ``protected_models`` names: the models and the calibration
    artifacts the slots' records were built with (a rollback rebuilds from them)."""
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    calibrations = {name: format(i, "064x") for i, name in enumerate(("active", "good"), 1)}

    def record(version: str, calibration: str) -> ModelRecord:
        path = tmp_path / "state" / "artifacts" / f"{calibration}.onnx"
        build = {"precision": "int8", "calibration": {"kind": "cache", "path": str(path)}}
        return ModelRecord(
            model_id="cls",
            version=version,
            sha256=sha256_file(v1),
            path=str(v1),
            backend="onnxruntime",
            build=build,
        )

    state_file = StateFile(tmp_path / "state" / "state.json")
    saved = record_activation(AgentState(), "cls", record("1", calibrations["good"]))
    state_file.save(record_activation(saved, "cls", record("2", calibrations["active"])))
    models = _slot_models(tmp_path, _config(v1), state_file)

    protected = models.protected_models()

    assert protected == {sha256_file(v1), calibrations["active"], calibrations["good"]}


def test_a_rollback_past_its_reply_window_answers_running_and_a_second_one_follows_the_same(
    tmp_path: Path,
) -> None:
    """A rollback still under way when its reply is due (here: its record waits on the disk) answers
    ``running``; a retry meanwhile follows the same way back instead of answering that the slot was
    already rolled back, and both learn its one end."""
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=2)
    state_file = _HeldStateFile(tmp_path / "state" / "state.json")
    models = _slot_models(tmp_path, _config(v1), state_file)
    models.rollbacks = SlotRollback(models.owner, models.deployments.guard_runs, reply_within_s=0.2)
    models.load_initial("cls", _config(v1))
    models.activate_delivered(_request(v2, "2"))
    state_file.hold.set()

    first = models.rollback("cls")
    assert state_file.holding.wait(patient(20)), "the rollback never came to record its model"
    again = models.rollback("cls")
    assert isinstance(first, Followed)
    assert isinstance(again, Followed)
    assert first.interim["to"] == {"model_id": "cls", "version": "1"}
    assert again.done is first.done  # the same way back, not a second one
    state_file.release.set()
    assert first.done.result(timeout=patient(20))["model"]["version"] == "1"
    # Over now: the next one is refused, never forward to v2.
    with pytest.raises(NoRollbackTargetError, match="already rolled back to cls 1"):
        models.rollback("cls")
