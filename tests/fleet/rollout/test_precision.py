"""What a rollout's devices really run against the precision it asked for, from a real RolloutStore:
``rollout status`` (``precision``, its lines), the end of a DONE rollout, and what the store keeps of
a device's ``runs`` (bounded: a device chose every string)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.precision import REASON_CHARS, end_note
from agent.fleet.rollout.records import WaveState
from agent.fleet.rollout.report import rollout_status, status_lines
from agent.fleet.rollout.runner import RolloutRunner, job_figures
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.status_model import RolloutStatus
from agent.fleet.rollout.store import RolloutStore
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState, RunsInfo
from agent.specs.build import BuildSpec

GUARD = "INT8 accuracy guard: INT8 top-1 agrees with FP32 on 18.8% of 64 held-out frames"
FELL_BACK = RunsInfo(requested="int8", precision="fp32", source="built", fallback=GUARD)
AS_ASKED = RunsInfo(requested="int8", precision="int8", source="downloaded")


def _store(tmp_path: Path, devices: list[str], build: BuildSpec | None) -> tuple[RolloutStore, str]:
    request = RolloutRequest(
        model_sha256="0" * 64,
        model_name="shapes.onnx",
        slot="cls",
        version="2",
        devices=devices,
        waves="1,100%",
        build=build,
    )
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    store.create(request.plan("r1", "job-1", 1, {}, {}))
    return store, "r1"


def _active(store: RolloutStore, device: str, runs: RunsInfo | None) -> None:
    store.mark_sending("r1", device)
    store.mark_sent("r1", device)
    progress = DeviceProgress(device, 0, state=JobState.ACTIVE, runs=runs)
    store.record_job("r1", device, DeviceEnd.ACTIVE, job_figures(progress))


def _all_waves_done(store: RolloutStore, devices: dict[str, RunsInfo | None]) -> None:
    for wave, names in enumerate((list(devices)[:1], list(devices)[1:])):
        store.set_wave("r1", wave, WaveState.RUNNING, reason="started")
        for name in names:
            _active(store, name, devices[name])
        store.set_wave("r1", wave, WaveState.DONE, reason="gate holds")


def _runner(store: RolloutStore) -> RolloutRunner:
    # No wave is left to open: the runner only reads the store and writes the rollout's end.
    return RolloutRunner(
        store,
        "r1",
        settings=MqttSettings(host="127.0.0.1", port=1),
        model_path=lambda sha: Path("/nonexistent"),
        signing_key=None,
        key_id=None,
    )


def test_a_rollout_whose_devices_all_fell_back_says_so_in_its_end_and_its_status(tmp_path: Path) -> None:
    devices = ["jet-01", "jet-02", "jet-03"]
    store, rid = _store(tmp_path, devices, BuildSpec(precision="int8", device="cpu"))
    _all_waves_done(store, dict.fromkeys(devices, FELL_BACK))
    assert _runner(store).step() is True
    row = store.rollout(rid)
    assert (row.state.value, row.reason) == (
        "DONE",
        "every wave held; int8 asked, no device runs int8 (3 fell back to fp32)",
    )
    status = rollout_status(store, rid)
    RolloutStatus.model_validate(status)
    assert status["precision"] == {
        "requested": "int8",
        "running": {"fp32": 3},
        "sources": {"built": 3},
        "fell_back": [
            {"device": "jet-01", "wave": 1, "running": "fp32", "reason": GUARD},
            {"device": "jet-02", "wave": 2, "running": "fp32", "reason": GUARD},
            {"device": "jet-03", "wave": 2, "running": "fp32", "reason": GUARD},
        ],
        "fell_back_count": 3,
        "fell_back_to": {"fp32": 3},
    }
    lines = status_lines(status)
    assert "  precision: int8 asked; running fp32 3 (built 3)" in lines
    assert f"    jet-02  wave 2  runs fp32: {GUARD}" in lines


def test_some_devices_falling_back_and_none_are_said_apart(tmp_path: Path) -> None:
    store, rid = _store(tmp_path, ["jet-01", "jet-02"], BuildSpec(precision="int8"))
    _all_waves_done(store, {"jet-01": AS_ASKED, "jet-02": FELL_BACK})
    assert _runner(store).step() is True
    assert (
        store.rollout(rid).reason
        == "every wave held; int8 asked, 1 of 2 devices run another precision (fp32 1)"
    )
    assert rollout_status(store, rid)["precision"]["sources"] == {"built": 1, "downloaded": 1}
    store.close()

    plain, rid = _store(tmp_path / "plain", ["jet-01", "jet-02"], BuildSpec(precision="int8"))
    _all_waves_done(plain, {"jet-01": AS_ASKED, "jet-02": AS_ASKED})
    assert _runner(plain).step() is True
    assert plain.rollout(rid).reason == "every wave held"


def test_a_rollout_without_a_build_has_no_precision_to_report(tmp_path: Path) -> None:
    store, rid = _store(tmp_path, ["jet-01", "jet-02"], None)
    _all_waves_done(store, {"jet-01": RunsInfo(precision="fp32", source="model"), "jet-02": None})
    assert _runner(store).step() is True
    status = rollout_status(store, rid)
    assert (status["state"], status["reason"], status["precision"]) == ("DONE", "every wave held", None)
    assert not any(line.startswith("  precision:") for line in status_lines(status))
    assert end_note(None) == ""


def test_the_store_keeps_a_hostile_devices_runs_bounded(tmp_path: Path) -> None:
    hostile = RunsInfo(requested="i" * 10_000, precision="p" * 10_000, source="built", fallback="w" * 100_000)
    figures: dict[str, Any] = job_figures(DeviceProgress("jet-h", 0, state=JobState.ACTIVE, runs=hostile))
    assert len(json.dumps(figures["runs"])) < REASON_CHARS + 200
    assert len(figures["runs"]["fallback"]) == REASON_CHARS
    store, rid = _store(tmp_path, ["jet-h", "jet-02"], BuildSpec(precision="int8"))
    _all_waves_done(store, {"jet-h": hostile, "jet-02": FELL_BACK})
    status = rollout_status(store, rid)
    RolloutStatus.model_validate(status)
    assert max(len(line) for line in status_lines(status)) < 400
