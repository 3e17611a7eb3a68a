"""A full state disk costs nothing: a deploy arriving then ends ``FAILED disk_full`` (published, not
vanished), and the device retries it by itself once space returns and the broker is back; a disk
that fills during PROBATION leaves the old model serving, as state.json says (issue 19.8); a daemon
restarted on a full state disk serves.

A real daemon whose state directory is a real 16 MiB tmpfs filled to 0 bytes free, a real mosquitto
stopped and started, a real signed deploy pulled over MQTT from the real ChunkServer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.fsutil import sha256_file
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState, JobStatus, ResultMessage, decode
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, Fleet, count_version, ends_only_shadow
from tests.mqtt_probe import Probe, Received
from tests.small_disk import SmallDisk, small_disk

pytestmark = pytest.mark.slow


@pytest.fixture
def state_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A real 16 MiB filesystem (tmpfs) for the agent's state directory; needs root to mount."""
    with small_disk(tmp_path / "state-disk", "16m") as disk:
        yield disk


def _statuses(probe: Probe, job_id: str) -> list[JobStatus]:
    out: dict[str, JobStatus] = {}
    for m in probe.snapshot():
        if m.topic.endswith(f"/up/jobs/{job_id}"):
            status = decode(JobStatus, m.payload)
            out.setdefault(status.msg_id, status)  # a QoS 1 resend or a republication: same msg_id
    return list(out.values())


def test_deploy_on_a_full_disk_fails_disk_full_and_is_retried_when_space_returns(
    tmp_path: Path, private_broker: Broker, state_disk: SmallDisk
) -> None:
    broker = private_broker
    device = f"full-{uuid.uuid4().hex[:8]}"
    keys: KeyPairFiles = write_keypair(tmp_path / "keys", "ops-test")
    files = AgentFiles(tmp_path / "files", broker.port, device, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    delivery = {
        "trusted_keys": {keys.key_id: str(keys.public)},
        "disk_headroom_bytes": 0,
        "disk_full_retry_s": 0.5,
    }
    files.write_config(stream=stream, state_dir=str(state_disk.path / "state"), delivery=delivery)
    settings = MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.2, reconnect_max_s=1.0)
    plan = DeployPlan(
        model=files.v2, devices=(device,), slot="cls", version="2", model_id="cls", chunk_size=4096
    )
    deploy = FleetDeploy(settings, plan, signing_key=load_signing_key(keys.private), key_id=keys.key_id)
    job = deploy.job_id
    daemon = Daemon(files.config_path, tmp_path / "agent.log")
    topic = f"fleet/v1/{device}/up/jobs/+"
    try:
        with Probe(broker.host, broker.port) as before:
            before.subscribe(topic)
            daemon.wait_for_event("agent.started", timeout=60)
            state_disk.fill()
            deploy.start()
            before.wait_for(lambda _m: len(_statuses(before, job)) >= 1, timeout=30)

            # The broker goes away while the disk is still full: nothing is lost, nothing retried.
            broker.stop()
            time.sleep(1.0)
            state_disk.free()  # space returns while the broker is down: no retry without the link
            time.sleep(1.5)
            failed = _statuses(before, job)
        broker.restart()  # no persistence: a new observer; the agent reconnects after >= 0.5 s
        with Probe(broker.host, broker.port) as after:
            after.subscribe(topic)
            # (Not deploy.wait(): the fleet tool takes FAILED as the end; its chunk server keeps serving.)
            after.wait_for(lambda _m: JobState.ACTIVE in [s.state for s in _statuses(after, job)], timeout=60)
            retried = _statuses(after, job)
    finally:
        deploy.stop()
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert [(s.state, s.error_code) for s in failed] == [(JobState.FAILED, "disk_full")]
    assert failed[0].error is not None
    assert "jobs.json" in failed[0].error
    # The retry is a new run of the same job id after its disk_full end, as docs/protocol.md says.
    states = [s.state for s in retried]
    assert states[0] is JobState.QUEUED, states
    assert states[-1] is JobState.ACTIVE, states
    assert JobState.FAILED not in states
    assert states.count(JobState.QUEUED) == 1, states
    assert [e["event"] for e in daemon.events()].count("delivery.job.retry") == 1
    state = json.loads((state_disk.path / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["sha256"] == sha256_file(files.v2)


def test_a_state_disk_that_fills_during_probation_fails_the_job_and_the_old_model_serves_as_recorded(
    fleet: Fleet, device_id: str, probe: Probe, state_disk: SmallDisk
) -> None:
    """Issue 19.8: one job state, one serving model. The disk fills while the candidate is in
    PROBATION: its commit to state.json fails, so the previous model serves again, and the job's end
    (FAILED disk_full), up/info, state.json (what a restart brings back) and the results all say so.
    Once space returns the device retries the job, and all of them say ACTIVE v2 together."""
    files = fleet.files(device_id, disk_headroom_bytes=0, disk_full_retry_s=0.5)
    config = yaml.safe_load(files.config_path.read_text())
    config["state_dir"] = str(state_disk.path / "state")
    files.config_path.write_text(yaml.safe_dump(config))
    topics = Topics("fleet/v1", device_id)
    daemon = fleet.start(files)
    probe.wait_for(count_version("1", topics.results("cam")), timeout=60)
    shadow, lenient = ends_only_shadow(frames=3, sample_fps=10.0), ENDS_ONLY_PROBATION
    deploy = fleet.deploy(files.v2, [device_id], "2", shadow=shadow, probation_s=5.0, probation=lenient)
    job = deploy.job_id

    def states() -> list[JobState]:
        return [s.state for s in _statuses(probe, job)]

    try:
        probe.wait_for(lambda _m: JobState.PROBATION in states(), timeout=60)
        state_disk.fill()
        probe.wait_for(lambda _m: any(s.terminal for s in states()), timeout=30)
        failed = _statuses(probe, job)[-1]
        assert (failed.state, failed.error_code) == (JobState.FAILED, "disk_full"), failed
        probe.wait_for(lambda _m: _info_slot(probe, device_id).get("last_job_state") == "FAILED", timeout=20)
        info = _info_slot(probe, device_id)
        assert (info["model"]["version"], info["state"]) == ("1", "active")
        assert info["last_job_error_code"] == "disk_full"
        assert _active_version(state_disk) == "1"  # what a restart would bring back
        probe.wait_for(lambda ms: len(_results_after(ms, topics, failed.ts)) >= 10, timeout=30)
        assert {r.model.version for r in _results_after(probe.snapshot(), topics, failed.ts)} == {"1"}
        assert state_disk.free_bytes() == 0

        state_disk.free()  # space is back: the device retries the job by itself
        probe.wait_for(lambda _m: states()[-1] is JobState.ACTIVE, timeout=60)
        probe.wait_for(lambda _m: _info_slot(probe, device_id).get("last_job_state") == "ACTIVE", timeout=20)
        info = _info_slot(probe, device_id)
        assert info["model"]["version"] == "2"
        assert _active_version(state_disk) == "2"
    finally:
        deploy.stop()
    # One run to FAILED disk_full, then the retry: a new run of the same job id to ACTIVE (the one
    # documented exception to "one terminal state per job id", docs/protocol.md).
    run = states()
    assert run.count(JobState.QUEUED) == 2, run
    assert [s for s in run if s.terminal] == [JobState.FAILED, JobState.ACTIVE], run
    assert daemon.stop() == 0, daemon.log()[-3000:]


def _info_slot(probe: Probe, device: str) -> dict[str, Any]:
    """Slot ``cls`` of the last ``up/info`` received (empty before the first)."""
    infos = probe.on_topic(Topics("fleet/v1", device).info)
    if not infos:
        return {}
    slot: dict[str, Any] = json.loads(infos[-1].payload)["slots"]["cls"]
    return slot


def _active_version(disk: SmallDisk) -> str:
    state = json.loads((disk.path / "state" / "state.json").read_text())
    return str(state["slots"]["cls"]["active"]["version"])


def _results_after(messages: list[Received], topics: Topics, ts: float) -> list[ResultMessage]:
    return [r for r in unique_results(messages, topics.results("cam")) if r.published_at > ts]


def test_a_daemon_restarted_on_a_full_state_disk_serves_the_model_state_json_names(
    fleet: Fleet, device_id: str, probe: Probe, state_disk: SmallDisk
) -> None:
    """state.json cannot be written at start (the start-up load records what it loaded): the model
    serves all the same, since the next start chooses from the same state.json and config."""
    files = fleet.files(device_id)
    config = yaml.safe_load(files.config_path.read_text())
    config["state_dir"] = str(state_disk.path / "state")
    files.config_path.write_text(yaml.safe_dump(config))
    topics = Topics("fleet/v1", device_id)
    daemon = fleet.start(files)
    probe.wait_for(count_version("1", topics.results("cam")), timeout=60)
    state_disk.fill()
    assert daemon.stop() == 0, daemon.log()[-3000:]
    probe.clear()

    restarted = fleet.start(files)
    probe.wait_for(count_version("1", topics.results("cam")), timeout=60)
    assert state_disk.free_bytes() == 0
    events = [e.get("event") for e in restarted.events()]
    assert "agent.state.not_recorded" in events
    assert restarted.stop() == 0, restarted.log()[-3000:]
