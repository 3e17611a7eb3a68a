"""The configuration overlay as desired state against a real agent process and a real broker.

Signed ``_config`` desired states are published on ``down/desired/_config`` and served by a real
chunk server; the agent runs a looping file stream the whole time. The test stands in for systemd:
when the agent exits with the restart code it is started again, as ``Restart=on-failure`` does.
"""

from __future__ import annotations

import base64
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.lifecycle.config.record import OverlayFiles
from agent.lifecycle.restart import RESTART_EXIT_CODE
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import build_manifest
from agent.protocol.messages import InfoMessage, JobStatus, decode
from agent.signing import generate_keypair, private_key_from_bytes, sign
from tests.e2e.daemon import UNREACHABLE_URL_SOURCE, AgentFiles, Daemon
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

TERMINAL = {"ACTIVE", "FAILED", "REJECTED", "ROLLED_BACK", "SUPERSEDED"}


class ConfigDesk:
    """Signs and publishes configuration overlays for one device, serving their bytes."""

    def __init__(self, root: Path, probe: Probe, server: ChunkServer, device: str, key: bytes) -> None:
        self.root, self.probe, self.server, self.device = root, probe, server, device
        self.key = private_key_from_bytes(key)
        self.sequence = 0

    def publish(self, overlay: dict[str, Any] | str, version: str, probation_s: float = 3.0) -> str:
        job_id = f"cfg-{version}-{uuid.uuid4().hex[:6]}"
        document = self.root / f"{job_id}.yaml"
        document.write_text(overlay if isinstance(overlay, str) else yaml.safe_dump(overlay))
        self.sequence += 1
        manifest = build_manifest(
            document,
            job_id=job_id,
            sequence=self.sequence,
            slot="_config",
            model_id="config",
            version=version,
            chunk_size=4096,
            probation_s=probation_s,
        )
        self.server.register(manifest, document, verify=False)
        text = manifest.model_dump_json(exclude_none=True)
        signature = base64.b64encode(sign(self.key, text.encode())).decode()
        body = json.dumps({"manifest": text, "key_id": "k1", "signature": signature}).encode()
        self.probe.publish(f"fleet/v1/{self.device}/down/desired/_config", body, qos=1, retain=True)
        return job_id

    def statuses(self, job_id: str) -> list[JobStatus]:
        return [
            decode(JobStatus, m.payload)
            for m in self.probe.snapshot()
            if m.topic == f"fleet/v1/{self.device}/up/jobs/{job_id}"
        ]

    def final(self, job_id: str, timeout: float = 60) -> JobStatus:
        try:
            self.probe.wait_for(
                lambda _ms: any(s.state.value in TERMINAL for s in self.statuses(job_id)), timeout
            )
        except TimeoutError as timed_out:
            # The states seen and the agents' logs (a restart writes a new one) say where it stopped.
            seen = [s.state.value for s in self.statuses(job_id)]
            logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in self._logs())
            raise AssertionError(f"{job_id}: no end within {timeout}s; states {seen}{logs}") from timed_out
        return next(s for s in self.statuses(job_id) if s.state.value in TERMINAL)

    def _logs(self) -> list[Path]:
        return sorted(self.root.glob("agent-*.log"), key=lambda p: p.stat().st_mtime)[-2:]

    def info(self) -> InfoMessage:
        infos = [m for m in self.probe.snapshot() if m.topic == f"fleet/v1/{self.device}/up/info"]
        return decode(InfoMessage, infos[-1].payload)


class Device:
    """The agent process, started again after it exits with the restart code (systemd's part)."""

    def __init__(self, config: Path, root: Path) -> None:
        self.config, self.root, self.starts = config, root, 0
        self.daemon = self._start()

    def _start(self) -> Daemon:
        self.starts += 1
        return Daemon(self.config, self.root / f"agent-{self.starts}.log")

    def restarted(self, timeout: float = 60) -> None:
        """Wait for the restart exit, then start the agent again."""
        code = self.daemon.proc.wait(patient(timeout))
        assert code == RESTART_EXIT_CODE, self.daemon.log()[-3000:]
        self.daemon.stop()
        self.daemon = self._start()

    def killed(self) -> None:
        self.daemon.signal(signal.SIGKILL)
        self.daemon.kill()
        self.daemon = self._start()


def _more_results(probe: Probe, device: str, more: int = 10, timeout: float = 30) -> None:
    probe.wait_for_more(f"fleet/v1/{device}/up/results/cam", more, timeout)


@pytest.fixture
def rig(tmp_path: Path, broker: Broker) -> Any:
    device = f"cfg-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path, broker.port, device, frames=30)
    private_pem, public_pem = generate_keypair()
    (tmp_path / "k1.pub").write_bytes(public_pem)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    config = files.write_config(stream=stream, delivery={"trusted_keys": {"k1": str(tmp_path / "k1.pub")}})
    settings = MqttSettings(host=broker.host, port=broker.port)
    with Probe(broker.host, broker.port) as probe, ChunkServer(settings, group=f"g-{device}") as server:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        desk = ConfigDesk(tmp_path, probe, server, device, private_pem)
        agent = Device(config, tmp_path)
        try:
            _more_results(probe, device, 5, timeout=60)
            yield desk, agent, probe, device, files
        finally:
            agent.daemon.stop()


def test_live_change_is_applied_hot_and_an_invalid_overlay_changes_nothing(rig: Any, tmp_path: Path) -> None:
    desk, agent, probe, device, _files = rig
    bad = desk.publish({"streams": {"cam": {"fps_limit": -1}}}, "bad-1")
    final = desk.final(bad)
    assert (final.state.value, final.error_code) == ("REJECTED", "config_invalid")
    assert "streams.cam.fps_limit" in (final.error or "")
    denied = desk.publish({"mqtt": {"host": "elsewhere"}}, "bad-2")
    final = desk.final(denied)
    assert (final.state.value, final.error_code) == ("REJECTED", "config_invalid")
    assert "mqtt" in (final.error or "")
    huge = desk.publish({"labels": {f"k{i}": "v" * 200 for i in range(1500)}}, "bad-3")
    final = desk.final(huge)
    assert (final.state.value, final.error_code) == ("REJECTED", "too_large")
    assert [s.state.value for s in desk.statuses(huge)] == ["REJECTED"]  # nothing downloaded
    record = OverlayFiles(tmp_path / "state").read()
    assert record.active is None
    assert record.pending is None
    assert not [e for e in agent.daemon.events() if e.get("event") == "config.reload.applied"]

    job = desk.publish({"streams": {"cam": {"fps_limit": 5}}}, "live-1", probation_s=2)
    final = desk.final(job)
    assert final.state.value == "ACTIVE", final.error
    assert [s.state.value for s in desk.statuses(job)][-2:] == ["PROBATION", "ACTIVE"]
    assert agent.starts == 1
    assert agent.daemon.proc.poll() is None
    applied = agent.daemon.wait_for_event("config.overlay.applied")
    assert applied["how"] == "reload"
    wait_until(lambda: (desk.info().config or None) is not None and desk.info().config.version == "live-1")
    record = OverlayFiles(tmp_path / "state").read()
    assert record.active is not None
    assert record.last_good == record.active
    assert record.pending is None
    _more_results(probe, device, 5)


def test_restart_change_confirmed_and_a_broken_camera_put_back_by_itself(rig: Any, tmp_path: Path) -> None:
    desk, agent, probe, device, _files = rig
    job = desk.publish({"labels": {"site": "north"}}, "restart-1", probation_s=3)
    agent.restarted()
    final = desk.final(job)
    assert final.state.value == "ACTIVE", final.error
    wait_until(
        lambda: desk.info().labels.get("site") == "north" and desk.info().config.version == "restart-1"
    )

    broken = desk.publish({"streams": {"cam": {"source": UNREACHABLE_URL_SOURCE}}}, "broken-1", probation_s=4)
    agent.restarted()  # applied through a restart
    agent.restarted()  # put back through a restart
    final = desk.final(broken)
    assert (final.state.value, final.error_code) == ("ROLLED_BACK", "config_reverted")
    assert "no frames on stream(s) cam" in (final.error or "")
    _more_results(probe, device, 10)  # frames flow again
    record = OverlayFiles(tmp_path / "state").read()
    assert record.active is not None
    assert record.active.version == "restart-1"
    assert record.reverted is not None
    assert record.reverted.job_id == broken
    wait_until(lambda: desk.info().config.version == "restart-1" and desk.info().config.reverted is not None)
    # one terminal state per job
    for job_id in (job, broken):
        assert sum(1 for s in desk.statuses(job_id) if s.state.value in TERMINAL) == 1


def test_sigkill_during_probation_resumes_with_the_overlay_it_knows(rig: Any, tmp_path: Path) -> None:
    desk, agent, _probe, _device, _files = rig
    job = desk.publish({"labels": {"site": "south"}}, "kill-1", probation_s=6)
    agent.restarted()
    desk.probe.wait_for(lambda _ms: sum(s.state.value == "PROBATION" for s in desk.statuses(job)) >= 2, 60)
    agent.killed()  # during the probation after the restart
    record = OverlayFiles(tmp_path / "state").read()
    assert record.active is not None
    assert record.active.job_id == job
    assert record.pending is not None
    final = desk.final(job)
    assert final.state.value == "ACTIVE", final.error
    assert sum(1 for s in desk.statuses(job) if s.state.value in TERMINAL) == 1
    wait_until(lambda: desk.info().labels.get("site") == "south")

    # During the reading taken before a change (BUILDING, nothing applied yet): it starts again from there.
    # Each overlay is whole (desired state): it keeps the labels, or removing them would need a restart.
    south = {"site": "south"}
    early = desk.publish({"labels": south, "streams": {"cam": {"fps_limit": 8}}}, "kill-early", probation_s=2)
    desk.probe.wait_for(lambda _ms: any(s.state.value == "BUILDING" for s in desk.statuses(early)), 60)
    agent.killed()
    final = desk.final(early)
    assert final.state.value == "ACTIVE", final.error
    assert sum(1 for s in desk.statuses(early) if s.state.value in TERMINAL) == 1

    hot = desk.publish({"labels": south, "streams": {"cam": {"fps_limit": 7}}}, "kill-2", probation_s=8)
    desk.probe.wait_for(lambda _ms: any(s.state.value == "PROBATION" for s in desk.statuses(hot)), 60)
    agent.killed()  # during a hot change's probation: the new overlay is what starts, still pending
    record = OverlayFiles(tmp_path / "state").read()
    assert record.active is not None
    assert record.active.job_id == hot
    final = desk.final(hot)
    assert final.state.value == "ACTIVE", final.error
    assert sum(1 for s in desk.statuses(hot) if s.state.value in TERMINAL) == 1
