"""The devices of a rollout building their engine: listed in wave order, bounded, with build_note's
text, and printed by ``fleet rollout status`` under the waves."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agent.fleet.rollout.building import MAX_BUILDING, building_devices
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import WaveState
from agent.fleet.rollout.report import rollout_status, status_lines
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.status_model import RolloutStatus
from agent.fleet.rollout.store import RolloutStore
from agent.protocol.messages import BuildProgressInfo

CALIBRATING = BuildProgressInfo(
    phase="calibrating", frames_done=120, frames_total=500, elapsed_s=42.0, estimate_s=310.0
)


def store_with(tmp_path: Path, devices: list[str], waves: str = "100%") -> RolloutStore:
    request = RolloutRequest(
        model_sha256="9f" * 32, model_name="net.onnx", slot="main", version="4", devices=devices, waves=waves
    )
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    store.create(request.plan("r-1", "job-1", 1, {}, {}))
    store.set_wave("r-1", 0, WaveState.RUNNING, reason="started")
    for device in devices:
        store.mark_sending("r-1", device)
        store.mark_sent("r-1", device)
    return store


def test_the_status_lists_the_devices_building_with_their_phase_and_prints_them(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["jet-01", "jet-02", "jet-03"])
    store.record_job("r-1", "jet-03", DeviceEnd.ACTIVE)
    builds = {
        ("jet-02", "job-1"): CALIBRATING,
        ("jet-01", "job-1"): BuildProgressInfo(phase="building", elapsed_s=3.0),
        ("jet-03", "job-1"): CALIBRATING,  # ended: an old progress of it is not listed
        ("jet-01", "another-job"): CALIBRATING,  # not this rollout's job
    }
    status = rollout_status(store, "r-1", builds)
    lines = status_lines(status)
    store.close()
    RolloutStatus.model_validate(status)  # the schema `edge-agent schema` writes describes it

    assert [(b["device"], b["note"]) for b in status["building"]] == [
        ("jet-01", "building, 3 s"),
        ("jet-02", "calibrating 120/500 frames, 42 s of ~310 s"),
    ]
    assert status["building"][1] == {
        "device": "jet-02",
        "wave": 1,
        "phase": "calibrating",
        "frames_done": 120,
        "frames_total": 500,
        "elapsed_s": 42.0,
        "estimate_s": 310.0,
        "note": "calibrating 120/500 frames, 42 s of ~310 s",
    }
    assert status["building_left_off"] == 0
    start = lines.index("  2 device(s) building their engine:")
    assert lines[start + 1 : start + 3] == [
        "    jet-01  wave 1  building, 3 s",
        "    jet-02  wave 1  calibrating 120/500 frames, 42 s of ~310 s",
    ]


def test_without_builds_the_status_lists_none_and_prints_no_building_line(tmp_path: Path) -> None:
    store = store_with(tmp_path, ["jet-01"])
    status = rollout_status(store, "r-1")
    store.close()
    assert (status["building"], status["building_left_off"]) == ([], 0)
    assert not any("building" in line for line in status_lines(status))


def test_a_thousand_devices_building_are_listed_fifty_and_counted(tmp_path: Path) -> None:
    devices = [f"jet-{i:04d}" for i in range(1000)]
    store = store_with(tmp_path, devices)
    rows = store.devices("r-1")
    store.close()
    listed, left_off = building_devices(rows, {(d, "job-1"): CALIBRATING for d in devices})
    lines = status_lines({**_minimal(), "building": listed, "building_left_off": left_off})

    assert (len(listed), left_off) == (MAX_BUILDING, 950)
    assert lines[1] == "  1000 device(s) building their engine:"
    assert lines[-1] == "    ... and 980 more"


def test_a_device_id_with_control_characters_is_printed_escaped(tmp_path: Path) -> None:
    status = {**_minimal(), "building": [{"device": "jet\x1b[2J", "wave": 1, "note": "building, 1 s"}]}
    assert status_lines(status)[2] == "    jet\\x1b[2J  wave 1  building, 1 s"


def _minimal() -> dict[str, object]:
    policy = {"waves": "100%", "max_failed": "0", "soak_s": 0}
    return {
        "rollout_id": "r",
        "state": "RUNNING",
        "slot": "s",
        "model": "m",
        "version": "1",
        "policy": policy,
        "reason": "",
        "waves": [],
    }


def test_the_status_text_in_docs_fleet_md_is_what_status_prints_for_the_protocol_examples_document() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs"
    protocol = (docs / "protocol.md").read_text()
    section = protocol.split("\n### RolloutStatus\n", 1)[1].split("\n#", 1)[0]
    (document,) = re.findall(r"```json\n(.*?)```", section, re.S)
    fleet = (docs / "fleet.md").read_text()
    shown = fleet.split("<!-- rollout status text -->\n```\n", 1)[1].split("```", 1)[0]
    assert status_lines(json.loads(document)) == shown.rstrip("\n").splitlines()
