"""The agent updating itself through the fleet, end to end on real processes: mosquitto, a real
``edge-agent fleet controller`` signing with the operator's key, and a device that is the real agent
(``-m agent run``) started by the launcher from its installed first release, under a stand-in for
systemd's restart. The operator makes each agent release from a directory of wheels (this package
built with a bumped version, and a dependency it shares between releases) with ``fleet agent release``
and rolls it out with ``fleet rollout start --agent-release``, as docs/fleet.md says.

First a release that fails at import: the device puts its previous release back by itself, the job
ends ROLLED_BACK agent_reverted with the reason and the rollout's gate counts the failure. Then a
good release: QUEUED to ACTIVE over MQTT, the device restarted into it and confirmed on its own
health, ``up/info`` and ``fleet status`` naming it, and only the wheel the device did not hold pulled
over the chunk transfer (the shared dependency was kept from the first attempt).
"""

from __future__ import annotations

import json
import platform
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of
from agent.fsutil import sha256_file
from agent.mqtt.settings import MqttSettings
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import InfoMessage, JobStatus, decode
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles
from tests.fleet.controller_process import ControllerProcess
from tests.lifecycle.release.releases import BASE_VERSION, HERE, Device, Service
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

PREFIX = "fleet/v1"
BROKEN = "1.0.2"  # fails at import
GOOD = "1.0.5"  # needs the shared dependency (the "extra" wheel)
#: The confirmation deadline the operator gives (--probation-s): above the device's 60 s window.
DEADLINE_S = 240


@dataclass(frozen=True)
class Trust:
    """Whom the device trusts: the controller's key alone, or a fleet root (then the release key
    signs each agent release offline and the rollout carries the release)."""

    controller: KeyPairFiles
    delivery: dict[str, Any]  # agent.yaml's delivery section
    release_key: Path | None


@pytest.fixture(params=["controller-key", "fleet-root"])
def trust(request: pytest.FixtureRequest, tmp_path: Path) -> Trust:
    if request.param == "controller-key":
        keys = write_keypair(tmp_path / "keys", "ops-test")
        return Trust(keys, {"trusted_keys": {keys.key_id: str(keys.public)}}, None)
    versions.init(tmp_path / "trust", root_keys=1, threshold=1, expires_days=30)
    key_dir = tmp_path / "trust" / "keys"
    private = key_dir / "controller.key"
    controller = KeyPairFiles(key_id_of(private), private, key_dir / "controller.pub", "")
    root = tmp_path / "trust" / "root" / "1.root.json"
    return Trust(controller, {"trust_root": str(root)}, key_dir / "release.key")


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, trust: Trust) -> Iterator[ControllerProcess]:
    (tmp_path / "controller").mkdir()
    running = ControllerProcess(tmp_path / "controller", broker, PREFIX, keys=trust.controller).start()
    yield running
    running.kill()


class Watch:
    """What a probe heard of one device: its job statuses, its up/info, the chunk bytes sent to it."""

    def __init__(self, probe: Probe, device_id: str) -> None:
        self.probe = probe
        self.topics = Topics(PREFIX, device_id)

    def statuses(self) -> dict[str, list[JobStatus]]:
        jobs: dict[str, list[JobStatus]] = {}
        prefix = f"{PREFIX}/{self.topics.device_id}/up/jobs/"
        for m in self.probe.snapshot():
            if m.topic.startswith(prefix):
                status = decode(JobStatus, m.payload)
                jobs.setdefault(status.job_id, []).append(status)
        return jobs

    def job_of(self, known: set[str]) -> str | None:
        """The job of ``_agent`` not in ``known``, once its first status arrived."""
        new = [job for job, s in self.statuses().items() if job not in known and s[0].slot == "_agent"]
        return new[0] if new else None

    def job_ended(
        self, service: Service, known: set[str], reports: Callable[[TargetInfo], bool], what: str
    ) -> str:
        """Keep ``service`` running until a new ``_agent`` job ended and ``up/info``'s agent release
        ``reports`` what it should; that job's id."""
        found: list[str] = []

        def settled() -> bool:
            job = self.job_of(known)
            if job is None or self.ended(job) is None:
                return False
            found[:] = [job]
            release = self.release()
            return release is not None and reports(release)

        service.keep_until(settled, patient(400), what)
        return found[0]

    def terminal(self, job_id: str) -> set[str]:
        """Every terminal state the job published (one, however often it was sent)."""
        return {s.state.value for s in self.statuses()[job_id] if s.state.terminal}

    def ended(self, job_id: str) -> JobStatus | None:
        return next((s for s in self.statuses().get(job_id, []) if s.state.terminal), None)

    def release(self) -> TargetInfo | None:
        infos = [m for m in self.probe.snapshot() if m.topic == self.topics.info]
        return decode(InfoMessage, infos[-1].payload).agent_release if infos else None

    def chunk_bytes(self) -> dict[str, int]:
        """Chunk payload bytes per transfer (the SHA-256 of the file), in what was heard so far."""
        sent: dict[str, int] = {}
        xfer = f"{PREFIX}/{self.topics.device_id}/down/xfer/"
        for m in self.probe.snapshot():
            if m.topic.startswith(xfer):
                sha = m.topic[len(xfer) :]
                sent[sha] = sent.get(sha, 0) + len(m.payload)
        return sent


def release_dir(root: Path, device: Device, version: str) -> Path:
    """The operator's wheel directory (this package at ``version`` and the shared dependency) and its
    release document, made by ``fleet agent release`` (every wheel is pure Python: --python, --platform)."""
    root.mkdir()
    for name in (version, "extra"):
        shutil.copy(device.built.wheels[name], root)
    argv = ["fleet", "agent", "release", str(root), "--version", version]
    assert main([*argv, "--python", HERE, "--platform", platform.machine()]) == 0
    return root


def roll_out(broker: Broker, trust: Trust, wheels: Path, device_id: str, rollout_id: str) -> None:
    """``fleet rollout start --agent-release`` to one device, one wave, no failure allowed (on a fleet
    with a root: released first with ``fleet trust release --agent-release``)."""
    released: list[str] = []
    if trust.release_key is not None:
        out = wheels.with_suffix(".release.json")
        argv = ["fleet", "trust", "release", "--agent-release", str(wheels), "--key", str(trust.release_key)]
        assert main([*argv, "--out", str(out)]) == 0
        released = ["--release", str(out)]
    code = main(
        [
            "fleet", "rollout", "start", "--agent-release", str(wheels), "--device", device_id,
            "--id", rollout_id, "--waves", "1", "--max-failed", "0", "--probation-s", str(DEADLINE_S),
            *released, "--broker", f"{broker.host}:{broker.port}",
        ]
    )  # fmt: skip
    assert code == 0


def rollout_status(broker: Broker, rollout_id: str) -> dict[str, Any]:
    settings = MqttSettings(host=broker.host, port=broker.port)
    with ControllerClient(settings, timeout=30) as client:
        return client.request("status", {"rollout_id": rollout_id})


def rollout_ended(broker: Broker, rollout_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def ended() -> bool:
        seen.update(rollout_status(broker, rollout_id))
        return seen["state"] in ("DONE", "ABORTED")

    wait_until(ended, timeout=120, what=f"rollout {rollout_id} to end")
    return seen


def fleet_status(broker: Broker, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """What ``fleet status`` prints (the operator's view, from the devices' retained reports)."""
    capsys.readouterr()
    assert main(["fleet", "status", *flags, "--broker", f"{broker.host}:{broker.port}"]) == 0
    return capsys.readouterr().out


def test_an_agent_release_rolled_out_through_the_controller_is_put_back_or_confirmed(
    device: Device,
    broker: Broker,
    controller: ControllerProcess,
    trust: Trust,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    device_id = f"rel-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path / "files", broker.port, device_id, frames=300)
    looping = {"type": "file", "path": str(files.video), "loop": True, "realtime": True}
    config = files.write_config(
        state_dir=str(device.state),
        mqtt={"port": broker.port},
        stream={"source": looping},
        delivery=trust.delivery,
    )
    service = device.service_with(["-m", "agent", "run", "-c", str(config)])
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{PREFIX}/{device_id}/up/#")
        probe.subscribe(f"{PREFIX}/{device_id}/down/xfer/+")
        watch = Watch(probe, device_id)
        try:
            service.run_until(
                lambda: (r := watch.release()) is not None and r.version == BASE_VERSION, 120, "1.0.0 up"
            )
            broken_job = broken_release_put_back(device, broker, trust, service, watch, tmp_path, capsys)
            good_release_confirmed(device, broker, trust, service, watch, tmp_path, capsys, broken_job)
        finally:
            service.stop()


def broken_release_put_back(
    device: Device,
    broker: Broker,
    trust: Trust,
    service: Service,
    watch: Watch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """A release that fails at import: put back by the device itself, counted by the gate."""
    device_id = watch.topics.device_id
    roll_out(broker, trust, release_dir(tmp_path / "broken", device, BROKEN), device_id, "agent-broken")
    job = watch.job_ended(
        service,
        set(),
        lambda r: r.version == BASE_VERSION and r.reverted is not None,
        "the broken release put back",
    )
    end = watch.ended(job)
    assert end is not None
    assert (end.state.value, end.error_code) == ("ROLLED_BACK", "agent_reverted"), end.error
    assert "crashed at import: started 3 times and never reached start-up" in (end.error or "")
    assert watch.terminal(job) == {"ROLLED_BACK"}
    assert device.link("current") == device.link("good") == BASE_VERSION
    reported = watch.release()
    assert reported is not None
    assert reported.pending is None
    assert (reported.reverted or "").startswith(f"{BROKEN}: crashed at import")

    gate = rollout_ended(broker, "agent-broken")
    assert gate["state"] == "ABORTED", gate
    problems = gate.get("problem_devices") or []
    assert [(p["device"], p["error_code"]) for p in problems] == [(device_id, "agent_reverted")], gate
    table = fleet_status(broker, capsys)
    [line] = [x for x in table.splitlines() if x.split()[:1] == [device_id]]
    assert f"{BASE_VERSION} (reverted)" in line
    assert f"{device_id}: agent put back: {BROKEN}: crashed at import" in table
    return job


def good_release_confirmed(
    device: Device,
    broker: Broker,
    trust: Trust,
    service: Service,
    watch: Watch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    earlier_job: str,
) -> None:
    """A good release: QUEUED to ACTIVE, confirmed on the device's own health (its 60 s window), and
    only its changed wheel pulled (the dependency was kept by hash from the earlier attempt)."""
    device_id = watch.topics.device_id
    good = release_dir(tmp_path / "good", device, GOOD)
    agent_wheel = good / device.built.wheels[GOOD].name
    extra_wheel = good / device.built.wheels["extra"].name
    before = watch.chunk_bytes()
    assert sha256_file(extra_wheel) in before  # pulled by the earlier attempt
    roll_out(broker, trust, good, device_id, "agent-good")
    job = watch.job_ended(
        service,
        {earlier_job},
        lambda r: r.version == GOOD and r.pending is None,
        "the good release confirmed",
    )
    end = watch.ended(job)
    assert end is not None
    assert end.state.value == "ACTIVE", end.error
    assert watch.terminal(job) == {"ACTIVE"}
    states = [s.state.value for s in watch.statuses()[job]]
    assert states[0] == "QUEUED", states
    assert states.index("BUILDING") < states.index("PROBATION") < states.index("ACTIVE"), states
    assert device.link("current") == device.link("good") == GOOD
    kept = {p.name for p in device.releases.iterdir() if p.is_dir() and not p.is_symlink()}
    assert kept == {BASE_VERSION, GOOD, "wheels"}  # the broken release removed once one was confirmed
    reported = watch.release()
    assert reported is not None
    assert reported.job_id == job

    pulled = {sha: n for sha, n in watch.chunk_bytes().items() if n != before.get(sha)}
    assert pulled.get(sha256_file(agent_wheel)) == agent_wheel.stat().st_size
    assert set(pulled) == {sha256_file(agent_wheel), sha256_file(good / "agent-release.json")}
    assert rollout_ended(broker, "agent-good")["state"] == "DONE"

    rows = json.loads(fleet_status(broker, capsys, "--json"))
    [row] = [r for r in rows if r["device"] == device_id]
    assert row["agent_version"] == GOOD
    assert row["targets"]["agent"] == {"version": GOOD, "job_id": job, "pending": None, "reverted": None}
    [line] = [x for x in fleet_status(broker, capsys).splitlines() if x.split()[:1] == [device_id]]
    assert f" {GOOD} " in f"{line} "
