"""A full state disk costs nothing: a deploy arriving then ends ``FAILED disk_full`` (published, not
vanished), and the device retries it by itself once space returns and the broker is back.

A real daemon whose state directory is a real 16 MiB tmpfs filled to 0 bytes free, a real mosquitto
stopped and started, a real signed deploy pulled over MQTT from the real ChunkServer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.fleet.deploy import FleetDeploy
from agent.fleet.deploy_plan import DeployPlan
from agent.fleet.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fsutil import sha256_file
from agent.localbroker import Broker
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState, JobStatus, decode
from tests.e2e.daemon import AgentFiles, Daemon
from tests.mqtt_probe import Probe
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
