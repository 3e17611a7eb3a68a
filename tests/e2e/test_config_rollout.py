"""A configuration overlay rolled out in waves by a real controller process to real agent processes on
a real mosquitto, with the commands an operator types.

Three agents serve a looping file stream; the test stands in for systemd (an agent that exits with the
restart code is started again, as ``Restart=on-failure`` does). The first overlay changes a live key
(a stream's ``fps_limit``) and one that needs a restart (``labels``); the controller is SIGKILLed while
wave 2 runs and started again; every device ends ACTIVE and ``fleet status`` / ``fleet config get``
show the version. The second overlay points the first wave's camera at nothing: that device puts its
last good configuration back by itself (``ROLLED_BACK config_reverted``), the gate (``--max-failed 0``)
aborts, and the later waves never receive it. Probation is on, as users have it (a short window).
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient
from agent.fleet.deploy.keys import KeyPairFiles
from agent.lifecycle.config.record import OverlayFiles
from agent.lifecycle.restart import RESTART_EXIT_CODE
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.protocol.messages import JobState, JobStatus, decode
from agent.protocol.topics import Topics
from tests.e2e.daemon import UNREACHABLE_URL_SOURCE, Daemon
from tests.e2e.fleet_rig import Fleet, operator_settings
from tests.fleet.controller_process import ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PREFIX = "fleet/v1"


class Supervised:
    """An agent process started again whenever it exits with the restart code (systemd's part)."""

    def __init__(self, config: Path, root: Path) -> None:
        self.config, self.root = config, root
        self.starts = 0
        self.exits: list[int] = []
        self._lock = threading.Lock()
        self._stopping = False
        self.daemon = self._start()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _start(self) -> Daemon:
        self.starts += 1
        return Daemon(self.config, self.root / f"agent-{self.starts}.log")

    def _watch(self) -> None:
        while True:
            code = self.daemon.proc.wait()
            with self._lock:
                self.exits.append(code)
                if self._stopping or code != RESTART_EXIT_CODE:
                    return
                self.daemon.stop()
                self.daemon = self._start()

    def stop(self) -> int:
        with self._lock:
            self._stopping = True
            code = self.daemon.stop()
        self._thread.join()
        return code


def _statuses(probe: Probe, device: str, job_id: str) -> list[JobStatus]:
    topic = Topics(PREFIX, device).jobs(job_id)
    return [decode(JobStatus, m.payload) for m in probe.snapshot() if m.topic == topic]


def _more_results(probe: Probe, device: str, more: int, timeout: float = 60) -> None:
    probe.wait_for_more(Topics(PREFIX, device).results("cam"), more, timeout)


def _rollout(client_settings: Any, rollout_id: str) -> dict[str, Any]:
    with ControllerClient(client_settings, timeout=20) as client:
        status: dict[str, Any] = client.request("status", {"rollout_id": rollout_id})
    return status


def _desired_version(probe: Probe, device: str) -> str | None:
    topic = Topics(PREFIX, device).desired("_config")
    payloads = [m.payload for m in probe.snapshot() if m.topic == topic and m.payload]
    if not payloads:
        return None
    signed = SignedManifest.model_validate_json(payloads[-1])
    return DeployManifest.model_validate_json(signed.manifest).version


def _cli_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_an_overlay_rolls_out_in_waves_through_a_controller_kill_and_a_broken_camera_stops_the_next_one(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    rig = Fleet(tmp_path, broker, keys)
    run = uuid.uuid4().hex[:6]
    names = [f"wave-{run}-{i}" for i in range(3)]
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", PREFIX]
    settings = operator_settings(broker).model_copy(update={"prefix": PREFIX})
    (tmp_path / "controller").mkdir()
    controller = ControllerProcess(
        tmp_path / "controller", broker, PREFIX, "status_poll_s: 1\nselect_wait_s: 0.5\n", keys
    ).start()
    devices: dict[str, Supervised] = {}
    probe = Probe(broker.host, broker.port)
    for name in names:
        probe.subscribe(f"{PREFIX}/{name}/up/#")
        probe.subscribe(f"{PREFIX}/{name}/down/desired/_config")
    try:
        for name in names:
            files = rig.files(name)
            devices[name] = Supervised(files.config_path, files.root)
        for name in names:
            _more_results(probe, name, 5)

        first = tmp_path / "north.yaml"
        first.write_text(yaml.safe_dump({"streams": {"cam": {"fps_limit": 5}}, "labels": {"site": "north"}}))
        start = ["fleet", "rollout", "start", "--overlay", str(first), "--version", "cfg-1", "--id", "north"]
        start += ["--device", ",".join(names), "--waves", "1,2,100%", "--max-failed", "0"]
        assert main([*start, "--probation-s", "3", *broker_args]) == 0, capsys.readouterr().err
        job = _rollout(settings, "north")["job_id"]

        # While wave 2 runs (its device has the job), the controller dies and comes back.
        probe.wait_for(lambda _m: bool(_statuses(probe, names[1], job)), timeout=120)
        controller.kill()
        controller.start()
        wait_until(
            lambda: _rollout(settings, "north")["state"] in ("DONE", "ABORTED"),
            timeout=240,
            what="the first rollout's end",
        )
        status = _rollout(settings, "north")
        assert status["state"] == "DONE", status
        assert status["devices"] == {"ACTIVE": 3}, status
        for name in names:
            ends = [s.state for s in _statuses(probe, name, job) if s.state.terminal]
            assert ends == [JobState.ACTIVE], (name, _statuses(probe, name, job))
            assert devices[name].exits.count(RESTART_EXIT_CODE) == 1  # labels: applied by a restart

        def all_reported() -> bool:
            rows = _cli_json(capsys, ["fleet", "status", "--json", "--telemetry-wait", "0", *broker_args])
            seen = {row["device"]: row for row in rows if row["device"] in names}
            return all(
                (seen.get(n, {}).get("targets", {}).get("config") or {}).get("version") == "cfg-1"
                and seen[n]["labels"].get("site") == "north"
                for n in names
            )

        wait_until(all_reported, timeout=60, what="fleet status showing cfg-1 on every device")
        got = _cli_json(capsys, ["fleet", "config", "get", names[2], "--json", *broker_args])
        assert got["desired"]["version"] == "cfg-1"
        assert got["reported"]["version"] == "cfg-1"
        assert "fps_limit: 5" in got["desired"]["overlay"]

        # The second overlay is whole: it keeps the first's keys and breaks the camera.
        second = tmp_path / "broken.yaml"
        second.write_text(
            yaml.safe_dump(
                {
                    "streams": {"cam": {"fps_limit": 5, "source": UNREACHABLE_URL_SOURCE}},
                    "labels": {"site": "north"},
                }
            )
        )
        start = [
            "fleet",
            "rollout",
            "start",
            "--overlay",
            str(second),
            "--version",
            "cfg-2",
            "--id",
            "broken",
        ]
        start += ["--device", ",".join(names), "--waves", "1,2,100%", "--max-failed", "0"]
        assert main([*start, "--probation-s", "4", *broker_args]) == 0, capsys.readouterr().err
        broken = _rollout(settings, "broken")["job_id"]
        wait_until(
            lambda: _rollout(settings, "broken")["state"] in ("DONE", "ABORTED"),
            timeout=240,
            what="the second rollout's end",
        )
        status = _rollout(settings, "broken")
        assert status["state"] == "ABORTED", status
        reverted = [s for s in _statuses(probe, names[0], broken) if s.state.terminal]
        assert [(s.state, s.error_code) for s in reverted] == [(JobState.ROLLED_BACK, "config_reverted")]
        assert "no frames on stream(s) cam" in (reverted[0].error or "")
        _more_results(probe, names[0], 10)  # frames flow again, on the last good configuration
        record = OverlayFiles(devices[names[0]].root / "state").read()
        assert record.active is not None
        assert record.active.version == "cfg-1"
        assert record.reverted is not None
        assert record.reverted.job_id == broken
        for name in names[1:]:  # the later waves never received it
            assert _statuses(probe, name, broken) == []
            assert _desired_version(probe, name) == "cfg-1"

        def reverted_reported() -> bool:
            got = _cli_json(capsys, ["fleet", "config", "get", names[0], "--json", *broker_args])
            reported = got["reported"] or {}
            return reported.get("version") == "cfg-1" and "no frames" in (reported.get("reverted") or "")

        wait_until(reverted_reported, timeout=60, what="fleet config get: cfg-1 runs, cfg-2 put back and why")
    finally:
        probe.close()
        controller.kill()
        codes = {name: device.stop() for name, device in devices.items()}
    assert codes == dict.fromkeys(names, 0), codes
