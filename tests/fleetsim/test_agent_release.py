"""The simulated fleet's ``_agent`` target (simulated installs, real transfers): a release that changes
one wheel moves that wheel and the document only, over the real chunk pull, and one for another
machine is refused ``agent_incompatible``. Real processes, real mosquitto, real signed manifests."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.agent_release import make_release, read_release_dir, write_release
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.protocol.device_targets import AGENT_TARGET
from agent.protocol.messages import JobState
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.fleetsim.sim_fleet import SimFleet
from tests.waiting import patient

pytestmark = pytest.mark.slow

DEPENDENCIES = (
    "numpy-1.26.4-cp310-cp310-linux_aarch64.whl",
    "pydantic_core-2.14.6-cp310-cp310-linux_aarch64.whl",
)


def _release(folder: Path, agent_wheel: bytes, version: str, machine: str = "aarch64") -> Path:
    folder.mkdir()
    for name in DEPENDENCIES:
        (folder / name).write_bytes(name.encode() * 4000)  # the same bytes in every release
    (folder / f"edge_agent-{version}-py3-none-any.whl").write_bytes(agent_wheel)
    write_release(folder, make_release(folder, version=version, platforms=[machine]))
    return folder


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "sim-test")


@pytest.fixture
def fleet(tmp_path: Path, broker: Broker, keys: KeyPairFiles) -> Iterator[tuple[SimFleet, str, Path]]:
    prefix = unique_prefix()
    running = _release(tmp_path / "v1", secrets.token_bytes(50_000), "0.3.0")
    sim = SimFleet(tmp_path, broker, keys, prefix, devices=4, extra=["--agent-release", str(running)])
    yield sim, prefix, running
    sim.stop()


def _deploy(broker: Broker, prefix: str, keys: KeyPairFiles, folder: Path, devices: list[str]) -> FleetDeploy:
    release = read_release_dir(folder)
    plan = DeployPlan(
        model=release.document,
        devices=tuple(devices),
        slot=AGENT_TARGET,
        version=release.release.version,
        model_id="edge-agent",
        probation_s=120.0,
        wheels=release.wheels,
    )
    signing = load_signing_key(keys.private)
    return FleetDeploy(operator_settings(broker, prefix), plan, signing_key=signing, key_id=keys.key_id)


def test_an_update_of_one_wheel_moves_that_wheel_and_the_document_only(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, fleet: tuple[SimFleet, str, Path]
) -> None:
    sim, prefix, _running = fleet
    sim.wait_online()
    update = _release(tmp_path / "v2", secrets.token_bytes(60_000), "0.3.1")
    with _deploy(broker, prefix, keys, update, sim.ids) as deploy:
        outcome = deploy.wait(timeout=patient(120))
    assert {p.state for p in outcome.devices.values()} == {JobState.ACTIVE}, outcome.devices
    changed = (update / "edge_agent-0.3.1-py3-none-any.whl").stat().st_size
    document = (update / "agent-release.json").stat().st_size
    report = sim.wait_report_after(time.time())["devices"]
    for device in sim.ids:
        assert report[device]["fetched_bytes"] == changed + document, report[device]
        assert report[device]["agent_release"] == "0.3.1"


def test_a_release_for_another_machine_is_refused_agent_incompatible_and_the_running_one_stays(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, fleet: tuple[SimFleet, str, Path]
) -> None:
    sim, prefix, _running = fleet
    sim.wait_online()
    other = _release(tmp_path / "x86", secrets.token_bytes(1000), "0.3.1", machine="x86_64")
    with _deploy(broker, prefix, keys, other, sim.ids[:1]) as deploy:
        outcome = deploy.wait(timeout=patient(120))
    [progress] = outcome.devices.values()
    assert progress.state is JobState.REJECTED
    assert progress.error_code == "agent_incompatible"
    report = sim.wait_report_after(time.time())["devices"]
    assert report[sim.ids[0]]["agent_release"] == "0.3.0"
