"""A restarted controller knows the devices' last jobs again (issue 19, point 9).

Job states arrive on ``up/jobs/{job_id}``, which is not retained: a controller that restarts hears
none until a device publishes again. What it rebuilds from: each device's retained ``up/info``
(each slot's last job, its state and failure code) and its rollout store (the job's shadow and
probation figures). The controller is a real process, killed with SIGKILL and started again; the
devices' retained messages are left on a real mosquitto by a paho probe; the store is the real
store file, written as the controller writes it when it runs a rollout.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.demo.broker import Broker
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import RolloutState
from agent.fleet.rollout.store import RolloutStore
from agent.protocol.messages import (
    InfoMessage,
    JobEnd,
    JobState,
    ModelRef,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from tests.fleet.console_rig import make_rollout
from tests.fleet.controller_process import ControllerProcess
from tests.fleet.operator_side import unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

SHADOW = {"frames": 120, "agreement": 0.97, "latency_ratio": 1.4}
PROBATION_OK = {
    "elapsed_s": 60.0,
    "probation_s": 60.0,
    "baseline": {"p99_ms": 40.0},
    "current": {"p99_ms": 42.0},
}
PROBATION_FAILED = {
    "elapsed_s": 30.0,
    "probation_s": 60.0,
    "baseline": {"p99_ms": 40.0},
    "current": {"p99_ms": 130.0},
    "failed": {"figure": "p99_ratio", "value": 3.25, "bar": 1.5},
}


def _info(device: str, version: str, slot: SlotInfo) -> InfoMessage:
    return InfoMessage(
        device_id=device, agent_version="0.3.1", platform={}, backends={}, slots={"main": slot}, streams=[]
    )


def _slot(version: str, last_job: str, state: JobState, code: str | None = None) -> SlotInfo:
    failure = None if code is None else JobEnd(job_id=last_job, state=state, error_code=code, ts=1.7e9)
    return SlotInfo(
        model=ModelRef(slot="main", model_id="mobilenet", version=version, sha256="ab" * 32),
        state="active",
        since=1.7e9,
        last_job=last_job,
        last_job_state=state,
        last_job_error_code=code,
        last_failure=failure,
    )


def _store_a_finished_rollout(path: Path) -> None:
    """Rollout r-1 as the controller leaves it: jet-a ACTIVE, jet-b ROLLED_BACK, with their figures."""
    store = RolloutStore(path)
    try:
        make_rollout(store, "r-1", [["jet-a", "jet-b"]])
        for device, end, probation in (
            ("jet-a", DeviceEnd.ACTIVE, PROBATION_OK),
            ("jet-b", DeviceEnd.ROLLED_BACK, PROBATION_FAILED),
        ):
            store.mark_sending("r-1", device)
            store.mark_sent("r-1", device)
            figures: dict[str, Any] = {"state": end.value, "shadow": SHADOW, "probation": probation}
            if end is DeviceEnd.ROLLED_BACK:
                figures["error_code"] = "probation_failed"
            store.record_job("r-1", device, end, figures)
        store.set_state("r-1", RolloutState.DONE)
    finally:
        store.close()


def _jobs_known(controller: ControllerProcess) -> dict[str, list[dict[str, Any]]]:
    return {d: controller.json(f"/api/device/{d}")["jobs"] for d in ("jet-a", "jet-b", "jet-c")}


def _check_rebuilt(controller: ControllerProcess) -> None:
    wait_until(
        lambda: controller.json("/api/devices")["total"] == 3 and all(_jobs_known(controller).values()),
        timeout=30,
        what="the three devices and their jobs",
    )
    jobs = _jobs_known(controller)
    a, b, c = jobs["jet-a"][0], jobs["jet-b"][0], jobs["jet-c"][0]
    assert (a["job_id"], a["state"], a["shadow"], a["probation"]) == (
        "job-r-1",
        "ACTIVE",
        SHADOW,
        PROBATION_OK,
    )
    assert (b["job_id"], b["state"], b["error_code"]) == ("job-r-1", "ROLLED_BACK", "probation_failed")
    assert (b["shadow"], b["probation"]) == (SHADOW, PROBATION_FAILED)
    assert (c["job_id"], c["state"], c["error_code"]) == ("job-3", "FAILED", "build_failed")  # up/info alone
    assert c["shadow"] is None
    rows = {row["id"]: row["job"] for row in controller.json("/api/devices")["devices"]}
    assert rows["jet-a"] == {"slot": "main", "state": "ACTIVE", "code": None}
    metrics = controller.get("/metrics")[1].decode()
    job_series: dict[str, dict[str, str]] = {
        str(sample.labels["device"]): {str(k): str(v) for k, v in sample.labels.items()}
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "edge_slot_job_info" and sample.value == 1.0
    }
    assert job_series["jet-b"] == {
        "device": "jet-b",
        "error_code": "probation_failed",
        "job_id": "job-r-1",
        "slot": "main",
        "state": "ROLLED_BACK",
    }
    assert (job_series["jet-c"]["error_code"], job_series["jet-c"]["job_id"]) == ("build_failed", "job-3")


def test_a_restarted_controller_rebuilds_the_jobs_and_says_since_when_it_has_charts(
    tmp_path: Path, broker: Broker
) -> None:
    prefix = unique_prefix()
    controller = ControllerProcess(tmp_path, broker, prefix)
    _store_a_finished_rollout(tmp_path / "state" / "rollouts.sqlite")
    infos = {
        "jet-a": _info("jet-a", "5", _slot("5", "job-r-1", JobState.ACTIVE)),
        "jet-b": _info("jet-b", "4", _slot("4", "job-r-1", JobState.ROLLED_BACK, "probation_failed")),
        "jet-c": _info("jet-c", "2", _slot("2", "job-3", JobState.FAILED, "build_failed")),
    }
    try:
        with Probe(broker.host, broker.port) as devices:
            for device, info in infos.items():
                topics = Topics(prefix, device)
                online = StatusMessage(state="online", session=1, agent_version="0.3.1")
                devices.publish(topics.status, encode(online), retain=True)
                devices.publish(topics.info, encode(info), retain=True)
            controller.start()
            _check_rebuilt(controller)
            devices.publish(
                Topics(prefix, "jet-a").telemetry, encode(TelemetryMessage(**{"stream.cam0.fps": 25.0}))
            )
            wait_until(
                lambda: controller.json("/api/device/jet-a")["history"]["fps"] == [25.0], what="a chart point"
            )
            controller.kill()
            restarted_at = time.time()
            controller.start()
            _check_rebuilt(controller)
            detail = controller.json("/api/device/jet-a")
    finally:
        controller.kill()
    # The telemetry before the restart is gone: the page says since when its charts have data.
    assert detail["history"]["ts"] == []
    assert detail["history_since"] >= restarted_at
