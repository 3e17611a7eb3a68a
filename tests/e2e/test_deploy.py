"""End to end: ``fleet deploy`` (the real FleetDeploy and ChunkServer) against real daemons.

Real mosquitto, real ``python -m agent run`` processes, signed manifests verified with a key made by
``fleet keygen``'s code, models pulled chunk by chunk over MQTT. Transfers that must be caught half
way are slowed down with the deploy's own rate limit (``max_rate_bps``), not with sleeps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.devices.command import send_command
from agent.fleet.view.status import collect_fleet, format_table
from agent.fsutil import sha256_file
from agent.protocol.manifest import KIB
from agent.protocol.messages import InfoMessage, JobState, JobStatus, decode
from agent.protocol.topics import Topics
from tests.delivery.delivery_stack import HAPPY_PATH
from tests.e2e.daemon import REPO, unique_results
from tests.e2e.fleet_rig import Fleet, agent_state, count_version, finish, operator_settings
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

# -- helpers -----------------------------------------------------------------------------------------


# -- tests -------------------------------------------------------------------------------------------


def test_deploy_switches_results_without_a_gap_and_survives_a_restart(
    fleet: Fleet, device_id: str, probe: Probe
) -> None:
    files, daemon, topic = fleet.serving_v1(device_id, probe)

    outcome = finish(fleet.deploy(files.v2, [device_id]))

    assert outcome.ok, outcome.failures()
    assert outcome.devices[device_id].history == HAPPY_PATH
    probe.wait_for(count_version("2", topic.results("cam")), timeout=30)
    info = decode(InfoMessage, probe.on_topic(topic.info)[-1].payload)
    slot = info.slots["cls"]
    assert slot.model is not None
    assert (slot.model.version, slot.model.sha256) == ("2", sha256_file(files.v2))
    assert slot.last_job == outcome.job_id
    assert daemon.stop() == 0, daemon.log()[-3000:]

    results = unique_results(probe.snapshot(), topic.results("cam"))
    indices = [r.frame_index for r in results]
    assert indices == list(range(len(indices))), "a result frame is missing or repeated"
    versions = [r.model.version for r in results]
    switch = versions.index("2")
    assert set(versions[:switch]) == {"1"}
    assert set(versions[switch:]) == {"2"}
    assert agent_state(files)["slots"]["cls"]["active"]["origin"] == "delivery"

    # Restarted, the agent comes back on the deployed model, not the one its config names.
    probe.clear()
    restarted = fleet.start(files)
    probe.wait_for(lambda ms: len(unique_results(ms, topic.results("cam"))) >= 5, timeout=60)
    assert restarted.stop() == 0
    after = unique_results(probe.snapshot(), topic.results("cam"))
    assert {(r.model.version, r.model.sha256) for r in after} == {("2", sha256_file(files.v2))}


def test_agent_killed_half_way_resumes_and_refetches_at_most_one_window(fleet: Fleet, device_id: str) -> None:
    window, chunk = 2, 1 * KIB
    files = fleet.files(device_id, loop=False, chunk_window=window)
    fleet.start(files)
    # ~25 chunks at ~10 chunks/s: the kill lands mid-transfer.
    deploy = fleet.deploy(files.v2, [device_id], chunk_size=chunk, max_rate_bps=10 * chunk)
    try:
        size = deploy.manifest.size
        assert deploy.server is not None
        served = deploy.server.served_bytes
        wait_until(lambda: served(device_id) >= size // 2, timeout=60, what="half of the model served")
        fleet.daemons[0].proc.send_signal(signal.SIGKILL)
        fleet.daemons[0].proc.wait(patient(10))
        time.sleep(0.5)  # requests already received are still answered
        before = served(device_id)
        assert before < size, "the transfer finished before the kill; slow it down further"

        fleet.start(files)
        outcome = deploy.wait(patient(60))
    finally:
        deploy.stop()

    assert outcome.ok, outcome.failures()
    refetched = served(device_id) - size
    assert 0 <= refetched <= window * chunk, f"{refetched} bytes fetched again (window {window} x {chunk})"
    history = outcome.devices[device_id].history
    assert history[-1] is JobState.ACTIVE
    assert history.count(JobState.DOWNLOADING) == 2, history  # once per agent run: resumed, not restarted
    assert agent_state(files)["slots"]["cls"]["active"]["sha256"] == sha256_file(files.v2)


def test_broker_restart_mid_transfer_completes(
    tmp_path: Path, private_broker: Broker, keys: KeyPairFiles, device_id: str
) -> None:
    fleet = Fleet(tmp_path, private_broker, keys)
    try:
        files = fleet.files(device_id, loop=False, chunk_window=2, chunk_timeout_s=2.0)
        fleet.start(files)
        chunk = 1 * KIB
        deploy = fleet.deploy(files.v2, [device_id], chunk_size=chunk, max_rate_bps=10 * chunk)
        try:
            assert deploy.server is not None
            served = deploy.server.served_bytes
            wait_until(
                lambda: served(device_id) >= deploy.manifest.size // 3, timeout=60, what="a third served"
            )
            assert served(device_id) < deploy.manifest.size, "the transfer finished before the restart"
            private_broker.restart(hard=True)  # no persistence: the retained manifest is gone too
            outcome = deploy.wait(patient(60))
        finally:
            deploy.stop()
    finally:
        fleet.close()
    assert outcome.ok, outcome.failures()
    assert agent_state(files)["slots"]["cls"]["active"]["sha256"] == sha256_file(files.v2)


def test_deploy_to_three_agents_with_the_cli(fleet: Fleet, broker: Broker) -> None:
    devices = [f"trio-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    all_files = [fleet.files(d, loop=False) for d in devices]
    for files in all_files:
        fleet.start(files)
    # The CLI does not wait for devices that never connected (no --wait-unknown): let them connect.
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe("fleet/v1/+/up/status")
        wait_until(
            lambda: (
                {m.topic.split("/")[2] for m in probe.snapshot() if b'"online"' in m.payload} >= set(devices)
            ),
            timeout=60,
            what="the three agents online",
        )
    command = [
        sys.executable, "-m", "agent", "fleet", "deploy", str(all_files[0].v2),
        "--device", devices[0], "--device", ",".join(devices[1:]),
        "--slot", "cls", "--version", "2", "--chunk-size", "4096", "--timeout", "90",
        "--key", str(fleet.keys.private), "--key-id", fleet.keys.key_id,
        "--broker", f"{broker.host}:{broker.port}",
        "--probation-s", "0", "--no-shadow",  # not what this test is about
    ]  # fmt: skip
    run = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=patient(120))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all 3 device(s) ACTIVE" in run.stdout
    for device in devices:
        assert f"{device}  ACTIVE" in run.stdout
    v2 = sha256_file(all_files[0].v2)  # every AgentFiles writes the same v2 (same seed)
    for files in all_files:
        assert agent_state(files)["slots"]["cls"]["active"]["sha256"] == v2


def test_rollback_command_returns_to_the_previous_model(
    fleet: Fleet, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = fleet.files(device_id)
    daemon = fleet.start(files)
    results = Topics("fleet/v1", device_id).results("cam")
    probe.wait_for(count_version("1", results), timeout=60)
    assert finish(fleet.deploy(files.v2, [device_id])).ok
    probe.wait_for(count_version("2", results), timeout=30)

    command = [
        sys.executable, "-m", "agent", "fleet", "cmd", device_id, "rollback",
        "--args", '{"slot": "cls"}', "--broker", f"{broker.host}:{broker.port}",
    ]  # fmt: skip
    run = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=patient(60))
    assert run.returncode == 0, run.stdout + run.stderr
    reply = json.loads(run.stdout)
    assert reply["ok"] is True
    assert reply["result"]["model"]["version"] == "1"

    probe.clear()
    probe.wait_for(count_version("1", results), timeout=30)
    assert {r.model.version for r in unique_results(probe.snapshot(), results)} == {"1"}
    # Without a slot the command is refused with its error code, not ignored.
    refused = send_command(operator_settings(broker), device_id, "rollback", {}, timeout=10)
    assert (refused.ok, refused.error_code) == (False, "bad_args")
    assert daemon.stop() == 0


def test_bad_model_is_rejected_and_the_old_one_keeps_serving(
    fleet: Fleet, broker: Broker, device_id: str, probe: Probe
) -> None:
    files, daemon, topic = fleet.serving_v1(device_id, probe)
    state_before = (files.root / "state" / "state.json").read_text()
    truncated = files.root / "truncated.onnx"
    truncated.write_bytes(files.v2.read_bytes()[:3000])

    outcome = finish(fleet.deploy(truncated, [device_id]))

    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "bad_onnx"), progress
    assert "bad_onnx" in " ".join(outcome.failures())

    # A manifest naming another device, signed and published on this device's topic: refused.
    other = FleetDeploy(
        operator_settings(broker),
        DeployPlan(model=files.v2, devices=("someone-else",), slot="cls", version="3", model_id="cls"),
        signing_key=load_signing_key(fleet.keys.private),
        key_id=fleet.keys.key_id,
        serve=False,
    )
    probe.publish(topic.desired("cls"), other.payloads["someone-else"], retain=True)
    jobs = probe.wait_for_count(topic.jobs(other.job_id), 1, timeout=20)
    rejected = decode(JobStatus, jobs[-1].payload)
    assert (rejected.state, rejected.error_code) == (JobState.REJECTED, "wrong_device")

    # `fleet status` shows that last job and how it ended, not the model still active.
    def last_job_shown() -> bool:
        [row] = [r for r in collect_fleet(operator_settings(broker), quiet_s=0.3) if r.device == device_id]
        return f"cls={other.job_id} REJECTED wrong_device" in format_table([row])

    wait_until(last_job_shown, timeout=20, what="fleet status showing the refused job")
    [row] = [r for r in collect_fleet(operator_settings(broker), quiet_s=0.3) if r.device == device_id]
    assert row.slots["cls"]["version"] == "1"
    assert row.slots["cls"]["last_failure"]["error_code"] == "wrong_device"

    count = len(unique_results(probe.snapshot(), topic.results("cam")))
    probe.wait_for(lambda ms: len(unique_results(ms, topic.results("cam"))) >= count + 10, timeout=30)
    assert daemon.stop() == 0
    results = unique_results(probe.snapshot(), topic.results("cam"))
    indices = [r.frame_index for r in results]
    assert indices == list(range(len(indices))), "a result frame is missing or repeated"
    assert {r.model.version for r in results} == {"1"}
    state = agent_state(files)
    assert state["slots"]["cls"]["active"]["version"] == "1"
    assert state["slots"]["cls"] == json.loads(state_before)["slots"]["cls"]


def test_a_rate_capped_deploy_beside_a_fleet_serve_says_the_cap_did_not_hold(
    fleet: Fleet, broker: Broker, device_id: str, probe: Probe, tmp_path: Path
) -> None:
    files = fleet.files(device_id)
    fleet.start(files)
    probe.wait_for(count_version("1", Topics("fleet/v1", device_id).results("cam")), timeout=60)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "v2.onnx").write_bytes(files.v2.read_bytes())
    # A `fleet serve` of the operator (its own group): it answers the same requests at full speed.
    with ChunkServer(operator_settings(broker)) as serve:
        serve.add_repo(repo)
        chunk = 1 * KIB
        outcome = finish(fleet.deploy(files.v2, [device_id], chunk_size=chunk, max_rate_bps=4 * chunk))

    assert outcome.ok, outcome.failures()
    p = outcome.devices[device_id]
    assert serve.served_bytes(device_id) >= p.bytes_total
    assert p.served < p.bytes_total  # the capped server sent a fraction; the device had it all
    assert p.foreign_bytes > 0
    [line] = outcome.rate_cap_lines()
    assert line.startswith(f"{device_id}: received")
    assert "--max-rate did not hold" in line
