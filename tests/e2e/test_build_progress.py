"""End to end: where an operator watches a rollout, a building device shows its build's phase.

Real processes throughout: mosquitto, a real ``edge-agent fleet controller`` process (signing with the
operator's key, its console on a free port), a real ``python -m agent run`` daemon, and the operator's
commands as processes: ``fleet rollout status --watch`` and ``fleet watch DEVICE``. The rollout asks
for an INT8 engine calibrated on 600 frames of the device's stream (a file played at its own 30 fps:
about 20 s of calibration), with shadow and probation on. While the job is BUILDING the device
publishes its progress (agent/engines/building/progress.py); the test checks that the controller keeps
it and that ``rollout status --json``, the text of ``--watch``, ``fleet watch`` and the console's
rollouts page (real Chromium) all show ``calibrating``, and that the entry is gone once the job left
BUILDING.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from agent.cli import main
from agent.datasets.shapes import MODEL_PATH
from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient
from agent.fsutil import sha256_file
from agent.protocol.topics import Topics
from tests.e2e.fleet_rig import Fleet, count_version, operator_settings
from tests.fleet.console import test_browser
from tests.fleet.controller_process import ROOT, ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import patient, patient_ms, wait_until

pytestmark = pytest.mark.slow

#: test_browser.py's fixtures: one Chromium per module, a page that fails the test on a script error.
browser = test_browser.browser
page = test_browser.page

ROLLOUT = "cls-int8-progress"
#: Calibration frames: at the stream's 30 fps, about 20 s of the BUILDING state's "calibrating" phase.
CALIBRATION_FRAMES = 600


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, fleet: Fleet) -> Iterator[ControllerProcess]:
    (tmp_path / "controller").mkdir()
    running = ControllerProcess(tmp_path / "controller", broker, "fleet/v1", keys=fleet.keys).start()
    yield running
    running.kill()


def command(args: list[str], out: Path, broker: Broker) -> subprocess.Popen[bytes]:
    """An operator's ``edge-agent fleet ...`` command as a process, its output to ``out``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with out.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "agent", "fleet", *args, "--broker", f"{broker.host}:{broker.port}"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def status_json(broker: Broker, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``fleet rollout status ID --json``, as the operator runs it."""
    capsys.readouterr()
    assert (
        main(["fleet", "rollout", "status", ROLLOUT, "--json", "--broker", f"{broker.host}:{broker.port}"])
        == 0
    )
    status: dict[str, Any] = json.loads(capsys.readouterr().out)
    return status


def test_a_building_device_shows_its_phase_in_rollout_status_watch_fleet_watch_and_the_console(
    fleet: Fleet,
    controller: ControllerProcess,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    page: Page,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet.start_shapes(device_id)
    probe.wait_for(count_version("1", Topics("fleet/v1", device_id).results("cam")), timeout=180)
    watching = command(["watch", device_id], tmp_path / "fleet-watch.txt", broker)
    body: dict[str, Any] = {
        "rollout_id": ROLLOUT,
        "model_sha256": sha256_file(MODEL_PATH),
        "model_name": MODEL_PATH.name,
        "model_id": "cls",
        "slot": "cls",
        "version": "2-int8",
        "devices": [device_id],
        "build": {
            "precision": "int8",
            "device": "cpu",
            "calibration": {"kind": "stream", "frames": CALIBRATION_FRAMES},
        },
        # Loose speed bars: the subject is the build's progress, and two cores are shared.
        "shadow": {"frames": 10, "sample_fps": 10.0, "min_agreement": 0.8, "max_latency_ratio": 1000.0},
        "probation_s": 2.0,
        "probation": {"min_fps_ratio": 0.1, "max_p99_ratio": 1000.0, "max_drop_increase": 0.9},
    }
    with ControllerClient(operator_settings(broker), timeout=30) as client:
        client.upload(MODEL_PATH, body["model_sha256"])
        client.request("start", body)
    status_watch = command(["rollout", "status", ROLLOUT, "--watch"], tmp_path / "status-watch.txt", broker)
    page.goto(controller.url + "/rollouts")

    seen: list[dict[str, Any]] = []

    def calibrating() -> bool:
        found = status_json(broker, capsys)["building"]
        seen.extend(b for b in found if b["phase"] == "calibrating")
        return bool(seen)

    wait_until(calibrating, timeout=120, what="the device calibrating in `rollout status --json`")
    shown = page.locator(
        f'section[data-rollout="{ROLLOUT}"] .building tr[data-device="{device_id}"] .build-note'
    )
    shown.wait_for(timeout=patient_ms(30))
    console_note = shown.inner_text()
    # The rollout goes on to its end: `--watch` returns with it (0: DONE).
    assert status_watch.wait(timeout=patient(300)) == 0, (tmp_path / "status-watch.txt").read_text()
    final = status_json(broker, capsys)
    watching.send_signal(signal.SIGINT)
    watching.wait(timeout=patient(30))
    watch_text = (tmp_path / "status-watch.txt").read_text()
    fleet_watch_text = (tmp_path / "fleet-watch.txt").read_text()

    entry = seen[0]
    assert (entry["device"], entry["wave"]) == (device_id, 1)
    assert entry["note"].startswith("calibrating")
    assert entry["elapsed_s"] >= 0
    assert console_note.startswith("calibrating")
    # The text of --watch: the building device under the waves, in build_note's words.
    assert f"    {device_id}  wave 1  calibrating" in watch_text, watch_text
    assert "device(s) building their engine:" in watch_text
    # `fleet watch DEVICE`: the job's BUILDING lines carry the same note.
    building_lines = [
        line for line in fleet_watch_text.splitlines() if " BUILDING " in line and "(calibrating" in line
    ]
    assert building_lines, fleet_watch_text
    # Once the job left BUILDING the controller lists no build: it ran to ACTIVE.
    assert final["state"] == "DONE", final
    assert final["devices"] == {"ACTIVE": 1}
    assert final["building"] == []
