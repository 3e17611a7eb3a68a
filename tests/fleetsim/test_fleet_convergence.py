"""A small simulated fleet (real processes, real mosquitto, real signed manifests) under ``FleetDeploy``.

Each test runs ``python -m agent.fleetsim`` with 2 worker processes and deploys with the existing
:class:`~agent.fleet.deploy.run.FleetDeploy`, as the operator would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.devices.command import send_command
from agent.protocol.manifest import DEFAULT_CHUNK_SIZE
from agent.protocol.messages import InfoMessage, JobState, decode
from agent.protocol.proving import ShadowSpec
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.fleetsim.sim_fleet import SimFleet
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

# A simulated fleet per test, deployed to for real and waited on: tens of seconds.
pytestmark = pytest.mark.slow


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "sim-test")


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    """The model every device serves at start (cls 1) and the one deployed (cls 2)."""
    return (
        write_classifier(tmp_path / "cls-1.onnx", input_size=32, num_classes=4, seed=1),
        write_classifier(tmp_path / "cls-2.onnx", input_size=32, num_classes=4, seed=2),
    )


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


def _deploy(
    broker: Broker, prefix: str, keys: KeyPairFiles, model: Path, devices: list[str], **plan: object
) -> FleetDeploy:
    return FleetDeploy(
        operator_settings(broker, prefix),
        DeployPlan(model=model, devices=tuple(devices), slot="main", version="2", model_id="cls", **plan),  # type: ignore[arg-type]
        signing_key=load_signing_key(keys.private),
        key_id=keys.key_id,
        status_poll_s=5.0,
    )


@pytest.fixture
def make_fleet() -> Iterator[list[SimFleet]]:
    """Simulators a test appends here are stopped at its end."""
    started: list[SimFleet] = []
    yield started
    for fleet in started:
        fleet.stop()


def test_a_fleet_converges_active_and_its_unhealthy_devices_end_as_real_ones_do(
    tmp_path: Path,
    broker: Broker,
    keys: KeyPairFiles,
    models: tuple[Path, Path],
    prefix: str,
    make_fleet: list[SimFleet],
) -> None:
    # Device 5 cannot load the model, 6 disagrees in shadow, 7 gives NaN outputs in probation.
    unhealthy = ["1@5-5:load", "1@6-6:agreement", "1@7-7:nan_outputs"]
    fleet = SimFleet(
        tmp_path,
        broker,
        keys,
        prefix,
        devices=20,
        model=models[0],
        extra=[f"--unhealthy={u}" for u in unhealthy],
    )
    make_fleet.append(fleet)
    fleet.wait_online()
    with _deploy(
        broker, prefix, keys, models[1], fleet.ids, shadow=ShadowSpec(frames=10), probation_s=2.0
    ) as d:
        outcome = d.wait(timeout=patient(90))
    ends = {device: p.state for device, p in outcome.devices.items()}
    expected = dict.fromkeys(fleet.ids, JobState.ACTIVE)
    expected |= {
        fleet.ids[5]: JobState.ROLLED_BACK,
        fleet.ids[6]: JobState.REJECTED,
        fleet.ids[7]: JobState.ROLLED_BACK,
    }
    assert ends == expected
    assert outcome.devices[fleet.ids[6]].error_code == "shadow_disagrees"
    assert outcome.devices[fleet.ids[7]].error_code == "unhealthy"

    report = fleet.wait_report_after(time.time())
    devices = report["devices"]
    assert all(devices[device]["runs"] == {d.job_id: 1} for device in fleet.ids)
    assert {d for d in fleet.ids if devices[d]["slots"]["main"] == "cls:2"} == set(fleet.ids) - set(
        fleet.ids[5:8]
    )
    assert all(devices[d]["slots"]["main"] == "cls:1" for d in fleet.ids[5:8])
    assert devices[fleet.ids[0]]["jobs"][d.job_id] == [
        "QUEUED",
        "DOWNLOADING",
        "VERIFYING",
        "BUILDING",
        "VALIDATING",
        "SHADOW",
        "PROBATION",
        "ACTIVE",
    ]
    size = models[1].stat().st_size  # every device pulled the model once, over MQTT
    assert {devices[device]["fetched_bytes"] for device in fleet.ids} == {size}
    # ... and the report carries each pull's counters (bench/fleet.py sums them).
    chunks = -(-size // DEFAULT_CHUNK_SIZE)
    assert {devices[device]["pull"]["written"] for device in fleet.ids} == {chunks}
    assert all(devices[device]["pull"]["requested_chunks"] >= chunks for device in fleet.ids)

    # up/info (retained) names the model each device serves now, and its labels' platform.
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(Topics(prefix, fleet.ids[0]).info)
        probe.subscribe(Topics(prefix, fleet.ids[5]).info)
        infos = probe.wait_for(lambda got: len({r.topic for r in got}) == 2)
    by_device = {decode(InfoMessage, r.payload).device_id: decode(InfoMessage, r.payload) for r in infos}
    assert by_device[fleet.ids[0]].slots["main"].model.version == "2"  # type: ignore[union-attr]
    assert by_device[fleet.ids[5]].slots["main"].model.version == "1"  # type: ignore[union-attr]
    assert by_device[fleet.ids[5]].slots["main"].last_job_state is JobState.ROLLED_BACK


def test_a_desired_state_published_again_with_the_same_job_id_is_ignored(
    tmp_path: Path,
    broker: Broker,
    keys: KeyPairFiles,
    models: tuple[Path, Path],
    prefix: str,
    make_fleet: list[SimFleet],
) -> None:
    fleet = SimFleet(tmp_path, broker, keys, prefix, devices=4, model=models[0])
    make_fleet.append(fleet)
    fleet.wait_online()
    with _deploy(broker, prefix, keys, models[1], fleet.ids) as d:
        assert d.wait(timeout=patient(60)).ok
        payloads, job = d.payloads, d.job_id
    before = fleet.wait_report_after(time.time())["devices"]

    with Probe(broker.host, broker.port) as probe:
        for device, payload in payloads.items():
            probe.publish(Topics(prefix, device).desired("main"), payload, retain=True)
    # The command is handled after the manifest published before it (one dispatcher, in order).
    settings = operator_settings(broker, prefix)
    for device in fleet.ids:
        reply = send_command(settings, device, "status", timeout=20)
        assert reply.ok
        assert reply.result is not None
        slot = reply.result["delivery"]["slots"]["main"]
        assert slot["last_job"]["job_id"] == job
        assert slot["last_job"]["state"] == "ACTIVE"
        assert slot["running"] is None
    after = fleet.wait_report_after(time.time())["devices"]
    for device in fleet.ids:
        assert after[device]["jobs"][job] == before[device]["jobs"][job]
        assert after[device]["runs"] == {job: 1}


def test_a_device_offline_during_the_deploy_converges_when_it_comes_back(
    tmp_path: Path,
    broker: Broker,
    keys: KeyPairFiles,
    models: tuple[Path, Path],
    prefix: str,
    make_fleet: list[SimFleet],
) -> None:
    # Device 3 is switched off 3 s after the simulator started, and back on at 30 s (long enough for
    # the 8 s look below to fall inside the window on a loaded machine too).
    fleet = SimFleet(
        tmp_path, broker, keys, prefix, devices=6, model=models[0], extra=["--offline=1@3-3:3-30"]
    )
    make_fleet.append(fleet)
    away = fleet.ids[3]
    fleet.wait_online(fleet.ids[:3] + fleet.ids[4:])
    wait_until(
        lambda: fleet.device(away).get("restarts") == 0 and not fleet.device(away).get("running", True),
        30,
        "device 3 off",
    )
    with _deploy(broker, prefix, keys, models[1], fleet.ids) as d:
        d.wait(timeout=8)
        assert d.outcome().devices[away].state is None  # nothing heard from it: it is off
        outcome = d.wait(timeout=patient(90))
    assert {p.state for p in outcome.devices.values()} == {JobState.ACTIVE}
    report = fleet.wait_report_after(time.time())["devices"]
    # Running again (a restart, or its first start when a loaded machine began the schedule late).
    assert report[away]["running"]
    assert report[away]["runs"] == {d.job_id: 1}
    assert report[away]["slots"]["main"] == "cls:2"
