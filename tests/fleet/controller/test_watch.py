"""``fleet rollout status --watch`` against the real controller while a device builds its engine.

The controller is the real one (a thread runs its loop, :class:`tests.fleet.controller.test_process.Running`);
the building device is the test itself publishing the job states and build progress an agent
publishes (agent/engines/building/progress.py: a heartbeat every 2 s that moves only ``elapsed_s``).
Each poll of ``--watch`` is a request on the broker, so the test counts them instead of sleeping.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles
from agent.protocol.messages import BuildProgressInfo, JobState, JobStatus, encode
from agent.protocol.topics import ControllerTopics, Topics
from tests.fleet.controller.test_process import (
    SLOT,
    Running,
    _request,
    _start,
    _status,
    controller,
    keys,
    prefix,
)
from tests.fleet.operator_side import announce, operator_settings, tiny_model
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

__all__ = ["controller", "keys", "prefix"]  # fixtures this module's tests use

DEVICE = "b0"


def test_watch_prints_again_when_the_build_moves_on_not_when_only_its_seconds_do(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = operator_settings(broker, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    polls = ControllerTopics(prefix).request("status")
    with Probe(broker.host, broker.port) as probe:
        announce(probe, prefix, DEVICE)
        started = _start(settings, model, _request(model, [DEVICE], rollout_id="w"))
        job_topic = Topics(prefix, DEVICE).jobs(started["job_id"])

        def building(build: BuildProgressInfo) -> None:
            job = JobStatus(job_id=started["job_id"], slot=SLOT, state=JobState.BUILDING, build=build)
            probe.publish(job_topic, encode(job))

        building(BuildProgressInfo(phase="building", elapsed_s=1.0))
        wait_until(
            lambda: [b["elapsed_s"] for b in _status(settings, "w")["building"]] == [1.0],
            what="the controller showing the build",
        )
        probe.subscribe(polls)
        codes: list[int] = []
        watch = ["fleet", "rollout", "status", "w", "--watch", "--broker", f"{broker.host}:{broker.port}"]
        watching = threading.Thread(target=lambda: codes.append(main([*watch, "--prefix", prefix])))
        watching.start()
        # The heartbeat: only the seconds move. Two polls after each, the watch has seen it.
        seen = 1
        for elapsed in (3.0, 5.0, 7.0):
            building(BuildProgressInfo(phase="building", elapsed_s=elapsed))
            seen += 2
            probe.wait_for_count(polls, seen, timeout=30)
        building(BuildProgressInfo(phase="calibrating", frames_done=10, frames_total=100, elapsed_s=9.0))
        seen += 2
        probe.wait_for_count(polls, seen, timeout=30)
        probe.publish(
            job_topic, encode(JobStatus(job_id=started["job_id"], slot=SLOT, state=JobState.ACTIVE))
        )
        watching.join(timeout=patient(60))
    out = capsys.readouterr().out

    assert codes == [0]  # DONE
    notes = [line.split("wave 1", 1)[1].strip() for line in out.splitlines() if f"{DEVICE}  wave 1" in line]
    assert [note.split(",")[0] for note in notes] == ["building", "calibrating 10/100 frames"], out


def test_a_device_waiting_for_another_devices_build_counts_no_change_by_its_seconds_alone() -> None:
    from agent.fleet.cli.rollout import _without_clock

    def status(waited: float, waiting_for: str) -> dict[str, object]:
        device = {"device": DEVICE, "phase": "planning", "waiting_for": waiting_for, "waited_s": waited}
        return {"state": "RUNNING", "waves": [{"building": [device]}]}

    assert _without_clock(status(3.0, "jet-02")) == _without_clock(status(35.0, "jet-02"))
    assert _without_clock(status(3.0, "jet-02")) != _without_clock(status(3.0, "jet-03"))
