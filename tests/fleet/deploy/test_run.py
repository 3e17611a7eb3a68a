"""FleetDeploy against a real mosquitto, with a plain paho probe playing the devices.

The probe shares no code with the fleet side: it reads the retained manifests as a device would and
publishes job states and command replies by hand, so each of the deploy's rules is checked alone
(signing per device, following states, dropping repeats, reading a missed end with ``status``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.delivery.jobs.ledger import JobRecord
from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.deploy.plan import DeployPlan, new_job_id, next_sequence
from agent.fleet.deploy.run import FleetDeploy
from agent.protocol.delivery_errors import UnsignedError, WrongDeviceError
from agent.protocol.manifest import parse_signed
from agent.protocol.messages import (
    CommandReply,
    JobState,
    JobStatus,
    ProbationFigures,
    ShadowFigures,
    encode,
)
from agent.protocol.topics import Topics
from agent.signing import load_public_key
from tests.fleet.operator_side import announce, operator_settings, tiny_model, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def probe(broker: Broker) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as p:
        yield p


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


def _plan(tmp_path: Path, *devices: str) -> DeployPlan:
    return DeployPlan(
        model=tiny_model(tmp_path / "m.onnx"), devices=devices, slot="cls", version="7", chunk_size=4096
    )


def _status(deploy: FleetDeploy, state: JobState, **fields: object) -> bytes:
    return encode(JobStatus(job_id=deploy.job_id, slot="cls", state=state, **fields))


def test_each_device_gets_its_own_signed_retained_manifest(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    settings = operator_settings(broker, prefix)
    deploy = FleetDeploy(
        settings,
        _plan(tmp_path, "a", "b"),
        signing_key=load_signing_key(keys.private),
        key_id="ops",
        serve=False,
    )
    with deploy:
        pass  # publishing is all this test needs; the manifests stay retained after stop()
    trusted = {"ops": load_public_key(keys.public)}
    with Probe(broker.host, broker.port) as late:
        late.subscribe(f"{prefix}/+/down/desired/cls")
        retained = late.wait_for(lambda ms: len(ms) >= 2, timeout=5)
    by_device = {m.topic.split("/")[2]: m for m in retained}
    assert set(by_device) == {"a", "b"}
    assert all(m.retain for m in retained)
    manifest = parse_signed(by_device["a"].payload, trusted, True, "a")
    assert (manifest.device, manifest.job_id, manifest.sequence) == ("a", deploy.job_id, deploy.sequence)
    assert manifest.sha256 == deploy.manifest.sha256
    with pytest.raises(WrongDeviceError):
        parse_signed(by_device["b"].payload, trusted, True, "a")


def test_unsigned_deploy_is_refused_where_signatures_are_required(tmp_path: Path, broker: Broker) -> None:
    deploy = FleetDeploy(operator_settings(broker, unique_prefix()), _plan(tmp_path, "a"), serve=False)
    assert not deploy.signed
    assert parse_signed(deploy.payloads["a"], {}, False, "a").job_id == deploy.job_id
    with pytest.raises(UnsignedError):
        parse_signed(deploy.payloads["a"], {}, True, "a")


def test_later_deploys_outrank_earlier_ones() -> None:
    sequences = [next_sequence() for _ in range(100)]
    assert sequences == sorted(set(sequences))
    assert new_job_id("m", "1") != new_job_id("m", "1")
    assert new_job_id("a/../b", "v 1").count("/") == 0


def test_states_are_followed_repeats_dropped_and_nothing_undoes_the_end(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    seen: list[list[JobState]] = []
    deploy = FleetDeploy(
        operator_settings(broker, prefix),
        _plan(tmp_path, "dev"),
        serve=False,
        on_change=lambda ps: seen.append(list(ps[0].history)),
    ).start()
    jobs = Topics(prefix, "dev").jobs(deploy.job_id)
    try:
        probe.publish(jobs, _status(deploy, JobState.QUEUED))
        downloading = _status(deploy, JobState.DOWNLOADING, bytes_done=4096, bytes_total=deploy.manifest.size)
        probe.publish(jobs, downloading)
        probe.publish(jobs, downloading)  # a QoS 1 repeat: same msg_id
        probe.publish(Topics(prefix, "dev").jobs("another-job"), _status(deploy, JobState.FAILED))
        assert not deploy.wait(0.5).finished
        assert deploy.snapshot()[0].bytes_done == 4096
        probe.publish(jobs, _status(deploy, JobState.ACTIVE))
        probe.publish(jobs, _status(deploy, JobState.DOWNLOADING))  # late echo after the end
        outcome = deploy.wait(patient(5))
        deploy.poll(0.3)
    finally:
        deploy.stop()
    assert outcome.ok
    assert outcome.devices["dev"].history == [JobState.QUEUED, JobState.DOWNLOADING, JobState.ACTIVE]
    assert deploy.snapshot()[0].state is JobState.ACTIVE
    assert seen, "on_change was never called"


def test_a_missed_final_state_is_read_with_the_status_command(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    topics = Topics(prefix, "dev")
    probe.subscribe(topics.cmd("status"))
    deploy = FleetDeploy(
        operator_settings(broker, prefix), _plan(tmp_path, "dev"), serve=False, status_poll_s=0.2
    ).start()
    answered = threading.Event()

    def device() -> None:
        request = probe.wait_for_count(topics.cmd("status"), 1, timeout=10)[0]
        record = {"job_id": deploy.job_id, "state": "REJECTED", "error_code": "bad_onnx"}
        reply = CommandReply(
            command="status", ok=True, result={"delivery": {"slots": {"cls": {"last_job": record}}}}
        )
        probe.publish(request.response_topic or "", encode(reply), correlation_data=request.correlation_data)
        answered.set()

    thread = threading.Thread(target=device, daemon=True)
    thread.start()
    try:
        outcome = deploy.wait(patient(10))
    finally:
        deploy.stop()
    thread.join(patient(5))
    assert answered.is_set()
    assert json.loads(probe.on_topic(topics.cmd("status"))[0].payload)["args"] == {}
    progress = outcome.devices["dev"]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "bad_onnx")
    assert "dev: REJECTED bad_onnx" in outcome.failures()[0]


def test_a_missed_active_end_is_read_with_the_figures_the_device_kept(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    """The device's ledger keeps its job's final status (shadow and probation figures included) and
    the ``status`` reply carries it: a rollout's gate judges that, not a bare ACTIVE."""
    topics = Topics(prefix, "dev")
    probe.subscribe(topics.cmd("status"))
    deploy = FleetDeploy(
        operator_settings(broker, prefix), _plan(tmp_path, "dev"), serve=False, status_poll_s=0.2
    ).start()
    final = JobStatus(
        job_id=deploy.job_id,
        slot="cls",
        state=JobState.ACTIVE,
        timings_s={"shadow": 1.5, "probation": 4.0},
        shadow=ShadowFigures(frames=30, agreement=0.97, latency_ratio=1.05),
        probation=ProbationFigures(elapsed_s=4.0, probation_s=4.0, current={"p99_ratio": 1.1}),
    )
    # What the agent's delivery service answers: its ledger's record as JSON (DeliveryService.describe).
    record = JobRecord(
        job_id=deploy.job_id,
        slot="cls",
        sequence=deploy.sequence,
        sha256=deploy.manifest.sha256,
        model_id="m",
        version="7",
        state=JobState.ACTIVE,
        status=final,
    ).model_dump(mode="json")

    def device() -> None:
        request = probe.wait_for_count(topics.cmd("status"), 1, timeout=10)[0]
        reply = CommandReply(
            command="status", ok=True, result={"delivery": {"slots": {"cls": {"last_job": record}}}}
        )
        probe.publish(request.response_topic or "", encode(reply), correlation_data=request.correlation_data)

    thread = threading.Thread(target=device, daemon=True)
    thread.start()
    try:
        outcome = deploy.wait(patient(10))
    finally:
        deploy.stop()
    thread.join(patient(5))
    progress = outcome.devices["dev"]
    assert progress.state is JobState.ACTIVE
    assert (progress.shadow, progress.probation) == (final.shadow, final.probation)
    assert progress.timings_s == {"shadow": 1.5, "probation": 4.0}


def test_a_silent_device_is_reported_unfinished(tmp_path: Path, broker: Broker, prefix: str) -> None:
    with FleetDeploy(operator_settings(broker, prefix), _plan(tmp_path, "ghost"), serve=False) as deploy:
        outcome = deploy.wait(0.5)
    assert not outcome.finished
    assert not outcome.ok
    assert outcome.failures() == [
        "ghost: no final state (no job status received); the manifest stays retained for it"
    ]


def test_an_unknown_device_is_named_at_once_and_gets_no_manifest(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    announce(probe, prefix, "jet-01")
    plan = _plan(tmp_path, "jet-01", "jet-0l")
    deploy = FleetDeploy(operator_settings(broker, prefix), plan, serve=False, wait_unknown=False)
    with deploy:
        known, typo = deploy.snapshot()
        assert (known.unknown, typo.unknown, typo.skipped) == (False, True, True)
        probe.publish(Topics(prefix, "jet-01").jobs(deploy.job_id), _status(deploy, JobState.ACTIVE))
        # Nothing left to wait for once the known device is done: no timeout runs out for the typo.
        outcome = deploy.wait(timeout=None)
    assert outcome.skipped == ["jet-0l"]
    assert not outcome.ok
    assert not outcome.failed
    assert "jet-0l: unknown device: no retained status" in outcome.failures()[0]
    with Probe(broker.host, broker.port) as late:
        late.subscribe(f"{prefix}/+/down/desired/cls")
        late.settle(0.5)
        retained = {m.topic.split("/")[2] for m in late.snapshot()}
    assert retained == {"jet-01"}  # the misspelt id keeps no retained manifest on the broker


def test_an_unknown_device_is_waited_for_only_when_asked(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    probe.subscribe(f"{prefix}/+/down/desired/cls")
    deploy = FleetDeploy(operator_settings(broker, prefix), _plan(tmp_path, "jet-new"), serve=False)
    with deploy:
        assert deploy.snapshot()[0].unknown
        assert not deploy.poll(0.2)
        probe.wait_for(lambda ms: len(ms) >= 1, timeout=5)  # it got the manifest: it may still come
        announce(probe, prefix, "jet-new")
        probe.publish(Topics(prefix, "jet-new").jobs(deploy.job_id), _status(deploy, JobState.ACTIVE))
        outcome = deploy.wait(timeout=patient(10))
    assert outcome.ok
    assert not outcome.devices["jet-new"].unknown


def test_a_rate_capped_deploy_notices_bytes_it_did_not_send(
    tmp_path: Path, broker: Broker, prefix: str, probe: Probe
) -> None:
    announce(probe, prefix, "dev")
    plan = _plan(tmp_path, "dev")
    deploy = FleetDeploy(operator_settings(broker, prefix), plan, max_rate_bps=1000.0)
    total = deploy.manifest.size
    jobs = Topics(prefix, "dev").jobs(deploy.job_id)
    with deploy:
        # The device reports the whole file while this deploy's server sent it nothing: another
        # server (a `fleet serve`) answered its requests.
        for done in (0, 4096, total):
            probe.publish(jobs, _status(deploy, JobState.DOWNLOADING, bytes_done=done, bytes_total=total))
        probe.publish(jobs, _status(deploy, JobState.ACTIVE))
        outcome = deploy.wait(timeout=patient(10))
    assert outcome.devices["dev"].served == 0
    assert outcome.devices["dev"].foreign_bytes == total - 4096 - plan.chunk_size
    assert outcome.rate_cap_lines()[0].startswith("dev: received")
    assert "--max-rate did not hold" in outcome.rate_cap_lines()[0]
