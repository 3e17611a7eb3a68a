"""docs/protocol.md's fleet controller section: the examples are what the code accepts and sends."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent.fleet.rollout.gate import DeviceEnd, DeviceReport, GatePolicy, judge_wave
from agent.fleet.rollout.records import WaveState
from agent.fleet.rollout.report import rollout_status
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.rollout.waves import parse_max_failed
from agent.protocol.messages import BuildProgressInfo
from agent.protocol.topics import ControllerTopics

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def _example(heading: str) -> Any:
    text = DOC.read_text()
    match = re.search(rf"^### {heading}\n(.*?)(?=^#)", text + "\n#", re.S | re.M)
    assert match, heading
    (block,) = re.findall(r"```json\n(.*?)```", match.group(1), re.S)
    return json.loads(block)


def _shape(value: Any) -> Any:
    """The keys of a JSON value, nested (lists by their first item), without the values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [_shape(value[0])]
    return None


def test_the_rollout_request_example_is_what_the_controller_accepts_and_the_cli_sends() -> None:
    example = _example("RolloutRequest")
    request = RolloutRequest.model_validate(example)
    assert request.policy().max_failed == parse_max_failed("2%")
    assert request.model_dump(mode="json", exclude_none=True) == example


def test_the_rollout_status_example_has_the_keys_of_a_real_status(tmp_path: Path) -> None:
    request = RolloutRequest.model_validate(_example("RolloutRequest"))
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    rid = "mobilenet-4-canary"
    store.create(request.plan(rid, "job-1", 1, {}, {}))
    store.set_wave(rid, 0, WaveState.RUNNING, reason="started")
    store.mark_sending(rid, "jet-01")
    store.mark_sent(rid, "jet-01")
    healthy = {  # the example asks for shadow and probation: a healthy device sent both
        "state": "ACTIVE",
        "shadow": {"frames": 120, "agreement": 0.97},
        "probation": {"elapsed_s": 60.0, "probation_s": 60.0},
    }
    store.record_job(rid, "jet-01", DeviceEnd.ACTIVE, healthy)
    verdict = judge_wave([DeviceReport("jet-01", DeviceEnd.ACTIVE)], [], GatePolicy(parse_max_failed("2%")))
    store.set_wave(rid, 0, WaveState.DONE, figures=asdict(verdict.figures), reason=verdict.reason)
    store.set_wave(rid, 1, WaveState.RUNNING, reason="started")
    store.mark_sending(rid, "jet-02")
    store.mark_sent(rid, "jet-02")
    example = _example("RolloutStatus")
    # jet-02 builds its engine: the progress its BUILDING job status carried (JobStatus.build).
    (building,) = example["building"]
    build = BuildProgressInfo.model_validate(
        {k: v for k, v in building.items() if k not in ("device", "wave", "note")}
    )
    real = rollout_status(store, rid, {("jet-02", "job-1"): build})
    assert real["building"] == example["building"]  # the note too: build_note's text
    assert _shape(example) == _shape(real)
    assert _shape(example["waves"][0]) == _shape(real["waves"][0])
    assert example["waves"][0]["reason"] == verdict.reason
    assert [w["ends"] for w in example["waves"]] == [w["ends"] for w in real["waves"]]
    store.note(rid, "rollback", devices=["jet-01", "jet-03"], sha256="0" * 64, job_id="r", sequence=2)
    store.note(rid, "rollback_by_command", devices=["jet-02"])
    store.note(rid, "rollback_none", devices=[])
    store.note(rid, "rollback_done", ends={"jet-01": "ACTIVE", "jet-03": "ACTIVE", "jet-02": "ROLLED_BACK"})
    documented = re.search(r"`rollback` reads e\.g\. `(\{.*?\})`", DOC.read_text(), re.S)
    assert documented is not None
    assert rollout_status(store, rid)["rollback"] == json.loads(documented.group(1).replace("\n", " "))
    store.close()


def test_the_doc_spells_the_controller_topics() -> None:
    text = DOC.read_text()
    topics = ControllerTopics("{p}")
    assert f"`{topics.request('start').replace('/start', '/{verb}')}`" in text
    assert f"`{topics.reply('{client}')}`" in text
