"""The device's own targets rolled out by the real controller on a real mosquitto: a configuration
overlay and an agent release in waves through the same gate as a model, ``fleet config set`` with a
secret sealed to one device, and the controller SIGKILLed mid-rollout.

The devices are :mod:`tests.fleet.scripted_fleet`'s stand-ins for a simulated fleet (they check the
signature and keep one job per job id; ``_config``/``_agent`` jobs walk QUEUED to PROBATION and end as
scripted: ACTIVE, or ROLLED_BACK with ``config_reverted``/``agent_reverted``). Probation is on (the
targets' default watch windows).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.deploy.agent_release import make_release, write_release
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fsutil import sha256_file
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.protocol.messages import JobState
from agent.protocol.sealed import open_sealed
from agent.protocol.topics import Topics
from agent.signing import load_public_key
from tests.fleet.ca.ca_rig import device_key_and_csr, make_ca
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.controller_process import ControllerProcess
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.fleet.scripted_fleet import ScriptedFleet
from tests.mqtt_probe import Probe
from tests.waiting import wait_until


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def controller(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> Iterator[RunningController]:
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "controller",
        signing_key=keys.private,
        key_id=keys.key_id,
        status_poll_s=1.0,
        select_wait_s=0.5,
    )
    running = RunningController(config)
    yield running
    running.stop()


def _fleet(broker: Broker, prefix: str, keys: KeyPairFiles, names: list[str], target: str) -> ScriptedFleet:
    return ScriptedFleet(
        broker, prefix, names, slot=target, trusted={keys.key_id: load_public_key(keys.public)}
    )


def _broker_args(broker: Broker, prefix: str) -> list[str]:
    return ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]


def _desired(broker: Broker, prefix: str, device: str, target: str) -> DeployManifest:
    probe = Probe(broker.host, broker.port)
    try:
        topic = Topics(prefix, device).desired(target)
        probe.subscribe(topic)
        wait_until(
            lambda: any(m.topic == topic for m in probe.snapshot()), timeout=10, what=f"{topic} retained"
        )
        payload = next(m.payload for m in probe.snapshot() if m.topic == topic)
    finally:
        probe.close()
    return DeployManifest.model_validate_json(SignedManifest.model_validate_json(payload).manifest)


def test_a_configuration_rolls_out_in_waves_and_a_config_reverted_device_stops_it(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: RunningController,
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = [f"c{i}" for i in range(6)]
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("streams:\n  door:\n    fps_limit: 5\ntelemetry:\n  interval_s: 30\n")
    with _fleet(broker, prefix, keys, names, CONFIG_TARGET) as fleet:
        fleet.devices["c2"].end = JobState.ROLLED_BACK
        fleet.devices["c2"].error_code = "config_reverted"
        start = ["fleet", "rollout", "start", "--overlay", str(overlay), "--version", "cfg-2", "--id", "cfg"]
        start += ["--device", ",".join(names), "--waves", "1,3,100%", "--max-failed", "0", "--wait"]
        code = main([*start, *_broker_args(broker, prefix)])
        out = capsys.readouterr()
        assert code == 1, out.err  # the rollout ended ABORTED
        assert "rollout cfg: ABORTED" in out.out
        jobs = fleet.jobs()
        manifest = _desired(broker, prefix, "c0", CONFIG_TARGET)
    assert [len(jobs[n]) for n in names] == [1, 1, 1, 0, 0, 0]  # the third wave never started
    assert manifest.slot == CONFIG_TARGET
    assert manifest.model_id == "config"
    assert manifest.version == "cfg-2"
    assert manifest.sha256 == sha256_file(overlay)
    assert manifest.probation_s == 60.0  # a configuration's watch window, by default
    assert (
        tmp_path / "controller" / "models" / f"{sha256_file(overlay)}.onnx"
    ).read_bytes() == overlay.read_bytes()


def test_an_agent_release_rolls_out_with_its_wheels_and_the_gate_counts_an_agent_reverted_device(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: RunningController,
    capsys: pytest.CaptureFixture[str],
) -> None:
    wheels = tmp_path / "release"
    wheels.mkdir()
    for i, name in enumerate(
        ["edge_agent-0.3.0-py3-none-any.whl", "numpy-1.26.4-cp310-cp310-manylinux_2_17_aarch64.whl"]
    ):
        (wheels / name).write_bytes(secrets.token_bytes(3000 + i))
    write_release(wheels, make_release(wheels, version="0.3.0"))
    names = ["a0", "a1", "a2", "a3"]
    with _fleet(broker, prefix, keys, names, AGENT_TARGET) as fleet:
        fleet.devices["a1"].end = JobState.ROLLED_BACK
        fleet.devices["a1"].error_code = "agent_reverted"
        start = ["fleet", "rollout", "start", "--agent-release", str(wheels), "--id", "agent", "--json"]
        start += ["--device", ",".join(names), "--waves", "2,100%", "--max-failed", "1", "--wait"]
        assert main([*start, *_broker_args(broker, prefix)]) == 0  # one bad device is allowed: DONE
        statuses = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        manifest = _desired(broker, prefix, "a3", AGENT_TARGET)
        # No way back is sent for a target: each device put back its own previous release.
        assert main(["fleet", "rollout", "rollback", "agent", *_broker_args(broker, prefix)]) != 0
        assert "no model to go back to" in capsys.readouterr().err
        jobs = fleet.jobs()
    assert all(len(j) == 1 for j in jobs.values()), jobs
    assert statuses[-1]["state"] == "DONE"
    assert statuses[-1]["devices"] == {"ACTIVE": 3, "ROLLED_BACK": 1}
    assert manifest.model_id == "edge-agent"
    assert manifest.version == "0.3.0"
    assert manifest.probation_s == 120.0
    artifacts = {a.name: a for a in manifest.artifacts or ()}
    assert set(artifacts) == {p.name for p in wheels.glob("*.whl")}
    repository = tmp_path / "controller" / "models"
    for path in wheels.glob("*.whl"):
        assert artifacts[path.name].kind == "wheel"
        assert (repository / f"{artifacts[path.name].sha256}.onnx").read_bytes() == path.read_bytes()


def test_config_set_seals_the_secret_to_the_device_and_no_operator_file_holds_it(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: RunningController,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ca = make_ca(tmp_path / "pki")
    device_key, checked = device_key_and_csr("s0")
    DeviceAuthority.load(ca.ca.path).issue(checked)  # the CA's ledger keeps the certificate
    secret = secrets.token_urlsafe(24).encode()
    secret_file = tmp_path / "secret" / "door-password"
    secret_file.parent.mkdir()
    secret_file.write_bytes(secret + b"\n")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("streams:\n  door:\n    fps_limit: 5\n")
    args = _broker_args(broker, prefix)
    with _fleet(broker, prefix, keys, ["s0", "s1"], CONFIG_TARGET) as fleet:
        put = ["fleet", "config", "set", "s0", str(overlay), "--version", "cfg-3", "--wait"]
        put += ["--secret", f"streams.door.password=@{secret_file}"]
        assert main([*put, "--ca-dir", str(ca.ca.path), *args]) == 0
        capsys.readouterr()
        manifest = _desired(broker, prefix, "s0", CONFIG_TARGET)
        wait_until(
            lambda: fleet.devices["s0"].model["version"] == "cfg-3", timeout=10, what="s0 reports cfg-3"
        )
        assert main(["fleet", "config", "get", "s0", "--json", *args]) == 0
        got = json.loads(capsys.readouterr().out)
        changed = tmp_path / "changed.yaml"
        changed.write_text("streams:\n  door:\n    fps_limit: 10\nlabels:\n  site: berlin-3\n")
        assert main(["fleet", "config", "diff", "s0", str(changed), *args]) == 0
        diff = capsys.readouterr().out
        jobs = fleet.jobs()
    assert jobs["s1"] == []
    assert len(jobs["s0"]) == 1
    assert got["desired"]["version"] == "cfg-3"
    assert got["reported"]["version"] == "cfg-3"
    sealed = got["desired"]["overlay"].split("password: ", 1)[1].split()[0]
    assert open_sealed(sealed, device_key, "s0", "streams.door.password") == secret
    assert manifest.sha256 == got["desired"]["sha256"]
    assert diff.splitlines() == [
        '+ labels.site: "berlin-3"',
        "~ streams.door.fps_limit: 5 -> 10",
        '- streams.door.password: "<sealed>"',
    ]
    # The clear secret is in the operator's own file only: not in the controller's state (its
    # repository, its rollout store), not in the overlay the operator wrote, nowhere else.
    holders = [p for p in tmp_path.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert holders == [secret_file]


def test_a_secret_for_a_certificate_the_ca_did_not_issue_the_device_is_refused_before_anything_is_sent(
    tmp_path: Path, broker: Broker, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = make_ca(tmp_path / "ours")
    other = DeviceAuthority.load(make_ca(tmp_path / "other").ca.path)
    cert = tmp_path / "s0.crt"
    cert.write_bytes(other.issue(device_key_and_csr("s0")[1]).cert_pem)  # an attacker's key for s0
    (tmp_path / "secret").write_bytes(secrets.token_bytes(12))
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("labels:\n  site: a\n")
    put = ["fleet", "config", "set", "s0", str(overlay), "--version", "x", "--device-cert", str(cert)]
    put += ["--secret", f"streams.door.password=@{tmp_path / 'secret'}", "--ca-dir", str(ours.ca.path)]
    assert main([*put, *_broker_args(broker, prefix), "--timeout", "2"]) != 0
    assert "no current certificate for this key" in capsys.readouterr().err


def test_the_controller_killed_mid_configuration_rollout_resumes_with_no_job_twice_and_none_skipped(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    from agent.fleet.controller.client import ControllerClient

    settings = operator_settings(broker, prefix)
    names = [f"k{i}" for i in range(5)]
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("telemetry:\n  interval_s: 20\n")
    process = ControllerProcess(
        tmp_path, broker, prefix, "status_poll_s: 1\nselect_wait_s: 0.5\n", keys
    ).start()
    body = {
        "rollout_id": "kill",
        "slot": CONFIG_TARGET,
        "model_sha256": sha256_file(overlay),
        "model_name": "config.yaml",
        "model_id": "config",
        "version": "cfg-9",
        "devices": names,
        "waves": "2,100%",
        "on_timeout": "wait",
        "probation_s": 60.0,
    }
    try:
        with _fleet(broker, prefix, keys, names, CONFIG_TARGET) as fleet:
            fleet.set_online("k1", False)  # wave 1 (k0, k1) stays open: k1 is offline
            with ControllerClient(settings, timeout=20) as client:
                client.start(body, overlay)
            wait_until(lambda: len(fleet.jobs()["k0"]) == 1, timeout=30, what="k0 ran its job")
            process.kill()
            fleet.set_online("k1", True)  # it takes the retained desired state while no controller runs
            wait_until(lambda: len(fleet.jobs()["k1"]) == 1, timeout=30, what="k1 ran its job")
            process.start()

            def done() -> bool:
                with ControllerClient(settings, timeout=20) as client:
                    return client.request("status", {"rollout_id": "kill"})["state"] in ("DONE", "ABORTED")

            wait_until(done, timeout=90, what="the rollout's end")
            with ControllerClient(settings, timeout=20) as client:
                status = client.request("status", {"rollout_id": "kill"})
            jobs = fleet.jobs()
    finally:
        process.kill()
    assert status["state"] == "DONE", status
    assert status["devices"] == {"ACTIVE": 5}
    assert all(len(j) == 1 for j in jobs.values()), jobs  # none twice, none skipped
    assert {j[0] for j in jobs.values()} == {status["job_id"]}


def test_a_models_flags_on_a_target_rollout_are_refused_by_name_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("labels:\n  site: a\n")
    argv = ["fleet", "rollout", "start", "--overlay", str(overlay), "--version", "1", "--device", "d"]
    assert main([*argv, "--precision", "int8", "--rollback-on-abort", "--broker", "127.0.0.1:1"]) != 0
    assert "--precision, --rollback-on-abort: a model's flags" in capsys.readouterr().err
