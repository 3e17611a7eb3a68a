"""The real agent (``-m agent run``, as the unit starts it) on trial after an update: it reports which
release runs and which is on trial, is confirmed on its own health (connected, its camera's frames
flowing, its slot serving), or, never healthy, puts the previous release back itself, stops in order
and exits 75 so that the launcher starts the previous one.

The update is recorded as the running agent's apply records it (the job runner's part is tested with
the target in test_updates.py); the confirmation window is the record's, a few seconds here.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.lifecycle.health import HealthReading
from agent.lifecycle.release.confirmation import reading_record
from agent.lifecycle.release.layout import CURRENT, GOOD, PendingUpdate, Releases
from agent.lifecycle.restart import RESTART_EXIT_CODE
from agent.protocol.messages import InfoMessage, decode
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles
from tests.lifecycle.release.releases import BASE_VERSION, Device, Service, install_first
from tests.mqtt_probe import Probe
from tests.waiting import patient

pytestmark = pytest.mark.slow

CANDIDATE = "1.0.1"
#: Before the change the camera flowed, the broker was there, the slot served.
BEFORE = HealthReading(
    connected=True, streams_flowing=frozenset({"cam"}), streams=frozenset({"cam"}), slots_failing=frozenset()
)


def on_trial(
    device: Device, files: AgentFiles, *, port: int, deadline_s: float
) -> tuple[Releases, list[str]]:
    """Release 1.0.1 installed beside 1.0.0 and put on trial, as the running agent's apply does."""
    install_first(device.state, device.built.wheels[CANDIDATE].parent, device.env, CANDIDATE, adopt=False)
    looping = {"type": "file", "path": str(files.video), "loop": True, "realtime": True}
    config = files.write_config(state_dir=str(device.state), mqtt={"port": port}, stream={"source": looping})
    releases = Releases(device.releases)
    releases.write_update(
        PendingUpdate(
            job_id="job-1", previous=BASE_VERSION, candidate=CANDIDATE, deadline=time.time() + deadline_s,
            deadline_s=deadline_s, confirm_s=3.0, max_attempts=3, before=reading_record(BEFORE),
        )
    )  # fmt: skip
    releases.switch(CURRENT, CANDIDATE)
    return releases, ["-m", "agent", "run", "-c", str(config)]


def test_the_real_agent_on_trial_reports_it_and_is_confirmed_on_its_health(
    device: Device, broker: Broker, tmp_path: Path
) -> None:
    port = broker.port
    files = AgentFiles(tmp_path / "files", port, "rel-dev-1", frames=300)
    releases, args = on_trial(device, files, port=port, deadline_s=patient(90))
    topics = Topics("fleet/v1", "rel-dev-1")
    with Probe("127.0.0.1", port) as probe:
        probe.subscribe(topics.info)
        service = device.service_with(args)
        try:
            service.run_until(lambda: releases.read_outcome() is not None, 120, "the confirmation")
            info = probe.wait_for(bool)[0]  # the first up/info, published while the release is on trial
        finally:
            service.stop()
    outcome = releases.read_outcome()
    assert outcome is not None
    assert (outcome.job_id, outcome.version, outcome.outcome) == ("job-1", CANDIDATE, "active")
    assert releases.link(GOOD) == releases.link(CURRENT) == CANDIDATE
    reported = decode(InfoMessage, info.payload).agent_release
    assert reported is not None
    assert (reported.version, reported.job_id, reported.pending) == (CANDIDATE, "job-1", CANDIDATE)
    assert service.exits == []


def test_the_real_agent_never_healthy_puts_the_previous_release_back_and_exits_75(
    device: Device, tmp_path: Path
) -> None:
    with socket.socket() as closed:  # a port nothing listens on: the candidate never connects
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    files = AgentFiles(tmp_path / "files", port, "rel-dev-2", frames=300)
    releases, args = on_trial(device, files, port=port, deadline_s=8.0)
    service = device.service_with(args)
    try:
        service.run_until(lambda: RESTART_EXIT_CODE in service.exits and started(service, BASE_VERSION), 120,
                          "the previous release to run again")  # fmt: skip
    finally:
        service.stop()
    outcome = releases.read_outcome()
    assert outcome is not None
    assert outcome.outcome == "rolled_back"
    assert outcome.reason is not None
    assert outcome.reason.startswith("not confirmed within 8 s: not connected to the broker")
    assert releases.link(CURRENT) == releases.link(GOOD) == BASE_VERSION
    assert service.exits == [RESTART_EXIT_CODE]


def started(service: Service, version: str) -> bool:
    """The agent's own log says a process of ``version`` started (agent.started names its version)."""
    for line in service.output().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "agent.started" and event.get("version") == version:
            return True
    return False
