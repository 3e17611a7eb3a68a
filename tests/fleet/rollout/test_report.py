"""``fleet rollout status`` and ``list`` as an operator reads them, from a real RolloutStore: the waves
counted from 1, and the devices that went wrong named with their code and figure (issue 22.6, 22.7)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.problems import MAX_LISTED
from agent.fleet.rollout.records import RolloutState, WaveState
from agent.fleet.rollout.report import list_line, rollout_status, status_lines
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.status_model import RolloutStatus
from agent.fleet.rollout.store import RolloutStore
from agent.protocol.proving import ShadowSpec
from tests.fleet.store_sites import StoreSite

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
HEALTHY = {
    "state": "ACTIVE",
    "shadow": {"frames": 120, "agreement": 0.97},
    "probation": {"elapsed_s": 60.0, "probation_s": 60.0},
}
UNHEALTHY_ROLLBACK = {
    "state": "ROLLED_BACK",
    "error_code": "unhealthy",
    "shadow": {"frames": 120, "agreement": 0.95},
    "probation": {
        "elapsed_s": 31.0,
        "probation_s": 60.0,
        "failed": {"figure": "p99_ratio", "value": 2.6, "bar": 2.0},
    },
}


def _store(store_site: StoreSite, devices: list[str], waves: str) -> tuple[RolloutStore, str]:
    request = RolloutRequest(
        model_sha256="0" * 64,
        model_name="mobilenet.onnx",
        slot="main",
        version="4",
        devices=devices,
        waves=waves,
        shadow=ShadowSpec(),
        probation_s=60.0,
    )
    store = store_site.open()
    store.create(request.plan("r1", "job-1", 1, {}, {}))
    return store, "r1"


def _end(store: RolloutStore, rid: str, device: str, end: DeviceEnd, figures: dict[str, Any]) -> None:
    store.mark_sending(rid, device)
    store.mark_sent(rid, device)
    store.record_job(rid, device, end, figures)


@pytest.fixture
def tripped(store_site: StoreSite) -> tuple[RolloutStore, str]:
    store, rid = _store(store_site, ["jet-01", "jet-07", "jet-03", "jet-04"], "1,2,100%")
    store.set_wave(rid, 0, WaveState.RUNNING, reason="started")
    _end(store, rid, "jet-01", DeviceEnd.ACTIVE, HEALTHY)
    store.set_wave(rid, 0, WaveState.DONE, reason="gate holds")
    store.set_wave(rid, 1, WaveState.RUNNING, reason="started")
    _end(store, rid, "jet-07", DeviceEnd.ROLLED_BACK, UNHEALTHY_ROLLBACK)
    store.set_wave(rid, 1, WaveState.DONE, reason="gate holds")
    store.set_wave(rid, 2, WaveState.RUNNING, reason="started")
    _end(store, rid, "jet-03", DeviceEnd.REJECTED, {"state": "REJECTED", "error_code": "bad_signature"})
    # ACTIVE, but the figures it sent fail the rollout's bar (an ACTIVE end without figures is the
    # device's own verdict and counts as healthy: tests/fleet/rollout/test_gate.py).
    low = {"state": "ACTIVE", "shadow": {"frames": 120, "agreement": 0.5}}
    _end(store, rid, "jet-04", DeviceEnd.ACTIVE, low)
    return store, rid


def test_status_names_each_failed_rolled_back_or_unhealthy_device_with_code_and_figure(
    tripped: tuple[RolloutStore, str],
) -> None:
    store, rid = tripped

    status = rollout_status(store, rid)
    text = "\n".join(status_lines(status))

    by_device = {p["device"]: p for p in status["problem_devices"]}
    assert list(by_device) == ["jet-07", "jet-03", "jet-04"]  # wave order; the healthy jet-01 is not there
    assert by_device["jet-07"] == {
        "device": "jet-07",
        "wave": 2,
        "end": "ROLLED_BACK",
        "error_code": "unhealthy",
        "figure": "probation p99_ratio 2.6 crossed 2",
    }
    assert by_device["jet-03"] == {
        "device": "jet-03", "wave": 3, "end": "REJECTED", "error_code": "bad_signature", "figure": None
    }  # fmt: skip
    assert by_device["jet-04"]["end"] == "UNHEALTHY"
    assert "shadow agreement 0.5 below" in by_device["jet-04"]["figure"]  # the gate's own reason
    assert status["problem_devices_left_off"] == 0
    RolloutStatus.model_validate(status)  # the schema `edge-agent schema` writes describes it
    assert "  3 device(s) failed, rolled back, timed out or unhealthy:" in text
    assert "    jet-07  wave 2  ROLLED_BACK  unhealthy  probation p99_ratio 2.6 crossed 2" in text
    assert "    jet-03  wave 3  REJECTED  bad_signature" in text
    # docs/protocol.md's example entry is the real one
    documented = re.search(r'e\.g\.\n`(\{"device": "jet-07".*?\})`', DOC.read_text(), re.S)
    assert documented is not None
    assert json.loads(documented.group(1)) == by_device["jet-07"]
    store.close()


def test_waves_count_from_one_in_the_status_document_and_the_list_says_what_its_figures_are(
    tripped: tuple[RolloutStore, str],
) -> None:
    store, rid = tripped

    status = rollout_status(store, rid)

    assert [(w["wave"], w["index"]) for w in status["waves"]] == [(1, 0), (2, 1), (3, 2)]
    assert "  2 of 3 waves done  " in list_line(status)
    assert "wave 2/3" not in list_line(status)
    store.close()


def test_the_problem_list_is_bounded_and_says_how_many_were_left_off(store_site: StoreSite) -> None:
    devices = [f"d{i:03d}" for i in range(MAX_LISTED + 25)]
    store, rid = _store(store_site, devices, "100%")
    store.set_wave(rid, 0, WaveState.RUNNING, reason="started")
    for device in devices:
        _end(store, rid, device, DeviceEnd.FAILED, {"state": "FAILED", "error_code": "x" * 5000})

    status = rollout_status(store, rid)
    lines = status_lines(status)

    assert len(status["problem_devices"]) == MAX_LISTED
    assert status["problem_devices_left_off"] == 25
    assert all(len(p["error_code"]) <= 64 for p in status["problem_devices"])
    assert f"  {MAX_LISTED + 25} device(s) failed, rolled back, timed out or unhealthy:" in lines
    assert lines[-1] == f"    ... and {MAX_LISTED + 5} more (`--json` lists up to {MAX_LISTED})"
    store.close()


def test_a_soaking_wave_says_how_long_is_left_and_until_when(store_site: StoreSite) -> None:
    """Issue 22.8: "soaking 300 s" never said how much of it was left."""
    store, rid = _store(store_site, ["a", "b"], "1,100%")
    store.set_wave(rid, 0, WaveState.RUNNING, reason="started")
    _end(store, rid, "a", DeviceEnd.ACTIVE, HEALTHY)
    until = 1_795_627_073.129  # 2026-11-25 17:17:53 UTC
    store.set_wave(
        rid, 0, WaveState.SOAKING, figures={"soak_until": until}, reason="soaking 300 s; gate holds"
    )
    status = rollout_status(store, rid)

    assert "          soak: 4 min 10 s left (until 17:17:53 UTC)" in status_lines(status, now=until - 250)
    assert "          soak over at 17:17:53 UTC; the next wave starts" in status_lines(status, now=until + 1)
    store.close()


def test_an_aborted_rollout_reads_as_aborted_in_the_list_and_its_soaking_wave_as_cancelled(
    store_site: StoreSite,
) -> None:
    store, rid = _store(store_site, ["jet-01", "jet-02"], "1,100%")
    store.set_wave(rid, 0, WaveState.RUNNING, reason="started")
    _end(store, rid, "jet-01", DeviceEnd.ACTIVE, HEALTHY)
    store.set_wave(rid, 0, WaveState.DONE, reason="gate holds")
    store.set_wave(rid, 1, WaveState.RUNNING, reason="started")
    _end(store, rid, "jet-02", DeviceEnd.ACTIVE, HEALTHY)
    store.set_wave(rid, 1, WaveState.SOAKING, reason="soaking 300 s; gate holds")
    store.set_state(rid, RolloutState.ABORTED, "aborted by the operator")

    status = rollout_status(store, rid)
    text = "\n".join(status_lines(status))

    assert [(w["state"], w["reason"]) for w in status["waves"]] == [
        ("DONE", "gate holds"),
        ("CANCELLED", "cancelled: aborted by the operator"),
    ]
    assert status["waves"][1]["ended_at"] is not None, "it had started: it ended at the abort"
    assert "soaking" not in text
    assert "  1 of 2 waves done, 1 cancelled  " in list_line(status)
    store.close()
