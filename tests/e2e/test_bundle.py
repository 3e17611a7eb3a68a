"""End to end: offline bundles with real agent processes, a real mosquitto that is down while the
bundle is imported, a real controller process, and the `fleet bundle` / `import` commands.

The operator's broker holds the device's desired state (retained, as the controller publishes it)
and the fleet root chain; `fleet bundle` reads them back with their files into one signed file; the
device imports it with the broker down, runs the job offline with shadow and probation on (ends-only
bars, as fleet_rig's other tests), and when the broker is back its spooled job statuses reach the
operator and the controller's view shows the slot at the imported version. Bad bundles imported into
a running agent are refused by name and change nothing: the agent keeps serving its model.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.deploy.keys import load_signing_key
from agent.fleet.trust.keyring import key_id_of
from agent.fleet.trust.publish import publish_chain
from agent.lifecycle.config.record import OverlayFiles
from agent.mqtt.service_client import ServiceClient
from agent.protocol.device_targets import CONFIG_TARGET
from agent.protocol.messages import JobState, JobStatus, decode
from agent.protocol.topics import Topics
from agent.trust.bundle import INDEX_MEMBER, BundleIndex, SignedIndex, blob_member, signed_index
from tests.e2e.daemon import AgentFiles, Daemon
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, count_version, ends_only_shadow, operator_settings
from tests.fleet.controller_process import ControllerProcess
from tests.lifecycle.bundle.bundles import BundleTrust, device_target_states, members, rewrite
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

PREFIX = "fleet/v1"


def persistent_broker(tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker]) -> Broker:
    """A broker whose retained messages and the probe's session survive its stop and start."""
    persist = tmp_path / "mosquitto-db"
    persist.mkdir()
    return broker_factory(
        [
            "persistence true",
            f"persistence_location {persist}/",
            "autosave_interval 1",
            "max_queued_messages 0",
        ]
    )


def device_files(tmp_path: Path, broker: Broker, device: str, trust: BundleTrust) -> AgentFiles:
    files = AgentFiles(tmp_path / device, broker.port, device, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    files.write_config(
        stream=stream,
        delivery={"trust_root": str(trust.anchor)},
        mqtt={"reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
    )
    return files


def publish_desired(
    broker: Broker, trust: BundleTrust, device: str, payload: bytes, *, target: str = "cls"
) -> None:
    """What the controller publishes: the device's desired state and the root chain, retained."""
    settings = operator_settings(broker)
    publish_chain(settings, trust.directory)
    client = ServiceClient(settings)
    client.start(patient(10))
    try:
        client.publish(Topics(PREFIX, device).desired(target), payload, qos=1, retain=True)
        assert client.wait_published(patient(10))
    finally:
        client.stop()


def released_v2(trust: BundleTrust, files: AgentFiles, device: str, version: str = "2") -> tuple[str, bytes]:
    manifest, payload = trust.desired(
        files.v2 if version == "2" else files.v1,
        device=device,
        version=version,
        shadow=ends_only_shadow(),
        probation_s=2.0,
        probation=ENDS_ONLY_PROBATION,
    )
    return manifest.job_id, payload


def make_bundle(broker: Broker, trust: BundleTrust, files: AgentFiles, out: Path) -> Path:
    argv = ["fleet", "bundle", "--device", files.device_id, "--key", str(trust.controller_key)]
    argv += ["--from", str(files.root), "--broker", f"{broker.host}:{broker.port}", str(out)]
    assert main(argv) == 0
    return out


def import_bundle(bundle: Path, files: AgentFiles, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["import", str(bundle), "--config", str(files.config_path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def job_statuses(probe: Probe, device: str, job_id: str) -> list[JobStatus]:
    topic = Topics(PREFIX, device).jobs(job_id)
    return [decode(JobStatus, m.payload) for m in probe.snapshot() if m.topic == topic]


def job_states(probe: Probe, device: str, job_id: str) -> list[JobState]:
    return [status.state for status in job_statuses(probe, device, job_id)]


def job_ended(daemon: Daemon, job_id: str, state: str) -> Callable[[], bool]:
    def ended() -> bool:
        assert daemon.proc.poll() is None, daemon.log()[-3000:]
        return any(
            e.get("event") == "delivery.job.state" and e.get("job") == job_id and e.get("state") == state
            for e in daemon.events()
        )

    return ended


def kept_files(state_dir: Path) -> dict[str, bytes]:
    """What an import may write: the stores, the imported states, the kept root."""
    return {
        str(p.relative_to(state_dir)): p.read_bytes()
        for folder in ("models", "artifacts", "imported", "trust")
        for p in sorted((state_dir / folder).rglob("*"))
        if p.is_file()
    }


def slot_seen(controller: ControllerProcess, device: str) -> dict[str, Any]:
    status, body = controller.get(f"/api/device/{device}")
    if status != 200:
        return {}
    slots: dict[str, dict[str, Any]] = json.loads(body)["slots"]
    return slots.get("cls", {})


def test_a_bundle_imported_with_the_agent_stopped_and_the_broker_down_runs_offline_and_the_controller_agrees(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker], capsys: pytest.CaptureFixture[str]
) -> None:
    broker = persistent_broker(tmp_path, broker_factory)
    trust = BundleTrust.init(tmp_path / "trust")
    device = f"bundle-{uuid.uuid4().hex[:6]}"
    files = device_files(tmp_path, broker, device, trust)
    (tmp_path / "controller").mkdir()
    controller = ControllerProcess(tmp_path / "controller", broker, PREFIX).start()
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device}", session_expiry_s=600)
    probe.subscribe(f"{PREFIX}/{device}/up/#")
    try:
        daemon = Daemon(files.config_path, tmp_path / "agent-0.log")
        probe.wait_for(count_version("1", Topics(PREFIX, device).results("cam")), timeout=60)
        assert daemon.stop() == 0, daemon.log()[-3000:]

        job_id, payload = released_v2(trust, files, device)
        publish_desired(broker, trust, device, payload)
        bundle = make_bundle(broker, trust, files, tmp_path / "site.bundle")
        broker.stop()

        code, out = import_bundle(bundle, files, capsys)
        assert code == 0, out
        assert f"cls: job {job_id} (version 2) handed to the agent" in out
        assert "the agent takes them when it starts" in out
        daemon = Daemon(files.config_path, tmp_path / "agent-1.log")
        wait_until(job_ended(daemon, job_id, "ACTIVE"), timeout=90, what="the imported job ACTIVE offline")

        broker.start()
        probe.wait_for(lambda _m: JobState.ACTIVE in job_states(probe, device, job_id), timeout=60)
        states = job_states(probe, device, job_id)
        assert states[0] is JobState.QUEUED, states
        assert states.count(JobState.ACTIVE) == 1, states
        probe.wait_for(count_version("2", Topics(PREFIX, device).results("cam")), timeout=60)
        wait_until(
            lambda: (
                slot_seen(controller, device).get("version") == "2"
                and slot_seen(controller, device).get("last_job_state") == "ACTIVE"
            ),
            timeout=60,
            what="the controller's view of the slot at version 2, its job ACTIVE",
        )
        assert slot_seen(controller, device)["last_job"] == job_id
        # The retained desired state it got on reconnect is the one it ran: no second job.
        assert daemon.stop() == 0, daemon.log()[-3000:]
        assert job_states(probe, device, job_id).count(JobState.QUEUED) == 1
    finally:
        probe.close()
        controller.kill()


def re_signed(good: Path, out: Path, stranger: BundleTrust) -> Path:
    """``good`` with its index signed again by a controller key of another fleet."""
    signed = SignedIndex.model_validate_json(dict(members(good))[INDEX_MEMBER])
    index = BundleIndex.model_validate_json(signed.index)
    key = load_signing_key(stranger.controller_key)
    return rewrite(good, out, {INDEX_MEMBER: signed_index(index, key, key_id_of(stranger.controller_key))})


def test_bad_bundles_imported_into_a_running_agent_offline_change_nothing_then_a_good_one_is_taken(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker], capsys: pytest.CaptureFixture[str]
) -> None:
    broker = persistent_broker(tmp_path, broker_factory)
    trust = BundleTrust.init(tmp_path / "trust")
    device = f"bundle-{uuid.uuid4().hex[:6]}"
    files = device_files(tmp_path, broker, device, trust)
    # The bundles are made first, while the device is not connected: a retained desired state would
    # otherwise reach it over MQTT.
    job_id, payload = released_v2(trust, files, device)
    publish_desired(broker, trust, device, payload)
    good = make_bundle(broker, trust, files, tmp_path / "good.bundle")
    _, unreleased = trust.desired(files.v2, device=device, version="3", released=False)
    publish_desired(broker, trust, device, unreleased)
    unreleased_bundle = make_bundle(broker, trust, files, tmp_path / "unreleased.bundle")
    publish_desired(broker, trust, device, b"")  # cleared: only the bundles carry them
    elsewhere = device_files(tmp_path, broker, f"{device}-elsewhere", trust)
    publish_desired(broker, trust, elsewhere.device_id, released_v2(trust, elsewhere, elsewhere.device_id)[1])
    for_other = make_bundle(broker, trust, elsewhere, tmp_path / "other.bundle")
    model_sha = hashlib.sha256(files.v2.read_bytes()).hexdigest()
    flipped = bytearray(files.v2.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    bad = {
        for_other: f"not for this device ({device})",
        rewrite(good, tmp_path / "tampered.bundle", {blob_member(model_sha): bytes(flipped)}): (
            "the file was altered or damaged"
        ),
        re_signed(good, tmp_path / "unknown.bundle", BundleTrust.init(tmp_path / "stranger")): (
            "the bundle's signature is refused (unknown_key)"
        ),
        unreleased_bundle: "the desired state is refused (unreleased)",
        cut: "truncated",
        rewrite(good, tmp_path / "traversal.bundle", {}, inserted=(2, "../../x", b"x")): "path traversal",
    }

    probe = Probe(broker.host, broker.port, client_id=f"probe-{device}", session_expiry_s=600)
    probe.subscribe(f"{PREFIX}/{device}/up/#")
    daemon = Daemon(files.config_path, tmp_path / "agent.log")
    try:
        probe.wait_for(count_version("1", Topics(PREFIX, device).results("cam")), timeout=60)
        broker.stop()
        state = files.root / "state"
        before = kept_files(state)
        for bundle, says in bad.items():
            code, out = import_bundle(bundle, files, capsys)
            assert code == 1, (bundle.name, out)
            assert says in out, (bundle.name, out)
            assert kept_files(state) == before, bundle.name
        assert daemon.proc.poll() is None
        assert not any(e.get("event") == "bundle.handed_in" for e in daemon.events())

        code, out = import_bundle(good, files, capsys)
        assert code == 0, out
        assert f"the running agent (pid {daemon.proc.pid}) takes them now" in out
        wait_until(job_ended(daemon, job_id, "ACTIVE"), timeout=90, what="the imported job ACTIVE offline")
        broker.start()
        probe.wait_for(count_version("2", Topics(PREFIX, device).results("cam")), timeout=60)
        probe.wait_for(lambda _m: JobState.ACTIVE in job_states(probe, device, job_id), timeout=60)
        assert job_states(probe, device, job_id)[0] is JobState.QUEUED
    finally:
        probe.close()
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]


def target_seen(controller: ControllerProcess, device: str) -> dict[str, Any]:
    """The controller's view of the device (its console's device page): ``row.config`` is the
    configuration as ``up/info`` reports it."""
    status, body = controller.get(f"/api/device/{device}")
    return json.loads(body) if status == 200 else {}


def test_a_configuration_from_a_bundle_is_applied_offline_and_the_controller_sees_it_on_reconnect(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker], capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``_config`` entry imported into a running agent with the broker down is applied (live: a
    stream's rate) and watched offline, ends ACTIVE, and its statuses reach a real controller when the
    broker is back; the controller's view shows the device's configuration at the imported version."""
    broker = persistent_broker(tmp_path, broker_factory)
    trust = BundleTrust.init(tmp_path / "trust")
    device = f"bundle-{uuid.uuid4().hex[:6]}"
    files = device_files(tmp_path, broker, device, trust)
    states = device_target_states(
        trust,
        tmp_path / "targets",
        device,
        overlay_text="streams:\n  cam:\n    fps_limit: 5\n",
        probation_s=3.0,
    )
    manifest, payload = states[CONFIG_TARGET]
    publish_desired(broker, trust, device, payload, target=CONFIG_TARGET)
    # As docs/bundles.md shows it: the broker named by the controller's own configuration file.
    controller_yaml = tmp_path / "controller.yaml"
    controller_yaml.write_text(
        f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {PREFIX}}}\nstate_dir: {tmp_path / 'c'}\n"
    )
    argv = ["fleet", "bundle", "--device", device, "--key", str(trust.controller_key)]
    argv += ["--from", str(tmp_path / "targets"), "-c", str(controller_yaml)]
    assert main([*argv, str(tmp_path / "targets.bundle")]) == 0
    publish_desired(broker, trust, device, b"", target=CONFIG_TARGET)  # only the bundle carries it

    (tmp_path / "controller").mkdir()
    controller = ControllerProcess(tmp_path / "controller", broker, PREFIX).start()
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device}", session_expiry_s=600)
    probe.subscribe(f"{PREFIX}/{device}/up/#")
    daemon = Daemon(files.config_path, tmp_path / "agent.log")
    try:
        probe.wait_for(count_version("1", Topics(PREFIX, device).results("cam")), timeout=60)
        broker.stop()
        code, out = import_bundle(tmp_path / "targets.bundle", files, capsys)
        assert code == 0, out
        assert f"_config: job {manifest.job_id} (version c1) handed to the agent" in out, out
        wait_until(
            job_ended(daemon, manifest.job_id, "ACTIVE"),
            timeout=90,
            what="the imported overlay ACTIVE offline",
        )
        applied = daemon.wait_for_event("config.overlay.applied")
        assert applied["how"] == "reload"
        record = OverlayFiles(files.root / "state").read()
        assert record.active is not None
        assert (record.active.version, record.active.job_id) == ("c1", manifest.job_id)
        assert record.last_good == record.active

        broker.start()
        probe.wait_for(lambda _m: JobState.ACTIVE in job_states(probe, device, manifest.job_id), timeout=60)
        states_heard = job_states(probe, device, manifest.job_id)
        assert states_heard[0] is JobState.QUEUED, states_heard
        assert JobState.PROBATION in states_heard, states_heard
        assert [s for s in states_heard if s.terminal] == [JobState.ACTIVE], states_heard

        # The job statuses are not retained (a controller reconnecting after the device may miss the
        # replay); what the device runs is, in up/info, and the controller's view shows it.
        def controller_agrees() -> bool:
            config = target_seen(controller, device).get("row", {}).get("config") or {}
            return (config.get("version"), config.get("job_id")) == ("c1", manifest.job_id)

        wait_until(controller_agrees, timeout=60, what="the controller's view: configuration c1 from the job")
        config = target_seen(controller, device)["row"]["config"]
        assert (config["pending"], config["reverted"]) == (None, None), config
        assert daemon.proc.poll() is None  # a live change: no restart
    finally:
        probe.close()
        controller.kill()
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]


def entered(daemon: Daemon, job_id: str, state: str) -> Callable[[], bool]:
    def seen() -> bool:
        return any(
            e.get("event") == "delivery.job.state" and e.get("job") == job_id and e.get("state") == state
            for e in daemon.events()
        )

    return seen


@pytest.mark.parametrize("step", ["VERIFYING", "SHADOW", "PROBATION"])
def test_an_imported_job_killed_at_each_step_resumes_offline_at_the_next_start_and_ends_once(
    tmp_path: Path,
    broker_factory: Callable[[Sequence[str]], Broker],
    capsys: pytest.CaptureFixture[str],
    step: str,
) -> None:
    broker = persistent_broker(tmp_path, broker_factory)
    trust = BundleTrust.init(tmp_path / "trust")
    device = f"bundle-{uuid.uuid4().hex[:6]}"
    files = device_files(tmp_path, broker, device, trust)
    job_id, payload = released_v2(trust, files, device)
    publish_desired(broker, trust, device, payload)
    bundle = make_bundle(broker, trust, files, tmp_path / "site.bundle")
    publish_desired(broker, trust, device, b"")
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device}", session_expiry_s=600)
    probe.subscribe(f"{PREFIX}/{device}/up/#")
    broker.stop()
    try:
        code, out = import_bundle(bundle, files, capsys)
        assert code == 0, out
        first = Daemon(files.config_path, tmp_path / "agent-0.log")
        wait_until(entered(first, job_id, step), timeout=90, what=f"the imported job at {step}")
        first.kill()
        daemon = Daemon(files.config_path, tmp_path / "agent-1.log")
        wait_until(job_ended(daemon, job_id, "ACTIVE"), timeout=90, what="the resumed job ACTIVE")
        broker.start()
        probe.wait_for(count_version("2", Topics(PREFIX, device).results("cam")), timeout=60)
        probe.wait_for(lambda _m: JobState.ACTIVE in job_states(probe, device, job_id), timeout=60)
        code = daemon.stop()
        assert code == 0, daemon.log()[-3000:]
    finally:
        probe.close()
    terminal = {s.msg_id: s.state for s in job_statuses(probe, device, job_id) if s.state.terminal}
    assert list(terminal.values()) == [JobState.ACTIVE], job_states(probe, device, job_id)
