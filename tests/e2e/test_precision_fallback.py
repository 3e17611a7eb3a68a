"""End to end: a rollout asks for INT8, every device's accuracy guard refuses the engine and the
devices run FP32; the operator sees it everywhere, and a rollout that asks the gate to count it stops.

Real processes throughout: mosquitto, a real ``edge-agent fleet controller`` process (signing with the
operator's key, its console and ``/metrics`` on a free port), two real ``python -m agent run``
daemons serving the FP32 shapes model, real ONNX Runtime INT8 builds and real Chromium. The rollout
ships an INT8 calibration made on black frames (``--calib-cache``): on the devices' scenes of shapes
it saturates, and the guard's agreement with FP32 stays far below ``engines.int8_agreement`` (0.97):
each device rebuilds at FP16, which ONNX Runtime runs as FP32 on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Page

from agent.camera.preprocess import preprocess
from agent.cli import main
from agent.datasets.shapes import MODEL_PATH
from agent.demo.broker import Broker
from agent.engines.calibration.int8 import quantize_int8
from agent.fleet.controller.client import ControllerClient
from agent.fsutil import sha256_file
from agent.protocol.topics import Topics
from agent.specs.preprocess import PreprocessSpec
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, Fleet, count_version, ends_only_shadow, operator_settings
from tests.fleet.console import test_browser
from tests.fleet.controller_process import ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import patient_ms, wait_until

pytestmark = pytest.mark.slow

browser = test_browser.browser
page = test_browser.page

ROLLOUT = "cls-int8-fallback"


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, fleet: Fleet) -> Iterator[ControllerProcess]:
    (tmp_path / "controller").mkdir()
    running = ControllerProcess(tmp_path / "controller", broker, "fleet/v1", keys=fleet.keys).start()
    yield running
    running.kill()


def black_calibration(root: Path) -> Path:
    """An INT8 calibration table made on black frames: every activation range collapses."""
    spec = PreprocessSpec(width=64, height=64)
    black = np.stack([preprocess(np.zeros((64, 64, 3), np.uint8), spec)[0] for _ in range(16)])
    return quantize_int8(MODEL_PATH, root / "black", [black]).table_path


def fleet_json(args: list[str], broker: Broker, capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    assert main(["fleet", *args, "--json", "--broker", f"{broker.host}:{broker.port}"]) == 0
    return json.loads(capsys.readouterr().out)


def fleet_text(args: list[str], broker: Broker, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["fleet", *args, "--broker", f"{broker.host}:{broker.port}"]) == 0
    return capsys.readouterr().out


def test_int8_asked_and_fp32_running_shows_in_status_rollout_console_and_metrics_and_can_stop_a_rollout(
    fleet: Fleet,
    controller: ControllerProcess,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    page: Page,
    capsys: pytest.CaptureFixture[str],
) -> None:
    devices = [f"{device_id}-{i}" for i in range(2)]
    probe.subscribe("fleet/v1/+/up/#")
    for device in devices:
        fleet.start_shapes(device)
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)
    table = black_calibration(tmp_path)
    body: dict[str, Any] = {
        "rollout_id": ROLLOUT,
        "model_sha256": sha256_file(MODEL_PATH),
        "model_name": MODEL_PATH.name,
        "model_id": "cls",
        "slot": "cls",
        "version": "2-int8",
        "devices": devices,
        "build": {"precision": "int8", "device": "cpu"},
        "calib_sha256": sha256_file(table),
        # Each device builds its own: what runs is the subject here, not who builds (docs/engines.md).
        "share_engines": False,
        # Guarded as operators run it; the bars judge ends only, not a loaded host's latency.
        "shadow": ends_only_shadow(frames=5, sample_fps=10.0).model_dump(mode="json"),
        "probation_s": 2.0,
        "probation": ENDS_ONLY_PROBATION.model_dump(mode="json"),
    }
    with ControllerClient(operator_settings(broker), timeout=30) as client:
        client.upload(MODEL_PATH, body["model_sha256"])
        client.upload(table, body["calib_sha256"])
        client.request("start", body)

    def ended() -> bool:
        state: str = fleet_json(["rollout", "status", ROLLOUT], broker, capsys)["state"]
        return state != "RUNNING"

    wait_until(ended, timeout=300, what="the INT8 rollout to end")
    status = fleet_json(["rollout", "status", ROLLOUT], broker, capsys)
    # The gate allowed it (the default), and the end says what runs.
    assert status["state"] == "DONE", status
    assert status["reason"] == "every wave held; int8 asked, no device runs int8 (2 fell back to fp32)"
    (wave,) = status["waves"]
    assert wave["reason"].endswith("; 2 run another precision than asked (--precision-fallback allow)")
    precision = status["precision"]
    assert precision["requested"] == "int8"
    assert precision["running"] == {"fp32": 2}
    assert precision["sources"] == {"built": 2}
    assert precision["fell_back_count"] == 2
    assert {f["device"] for f in precision["fell_back"]} == set(devices)
    assert all(f["reason"].startswith("INT8 accuracy guard: ") for f in precision["fell_back"])
    text = fleet_text(["rollout", "status", ROLLOUT], broker, capsys)
    assert "  precision: int8 asked; running fp32 2 (built 2)" in text, text
    assert f"    {devices[0]}  wave 1  runs fp32: INT8 accuracy guard: " in text, text

    # fleet status: each device's slot says what it runs and why, as the device reported it.
    rows = {r["device"]: r for r in fleet_json(["status"], broker, capsys)}
    for device in devices:
        runs = rows[device]["slots"]["cls"]["runs"]
        assert (runs["requested"], runs["precision"], runs["source"]) == ("int8", "fp32", "built"), runs
        assert "below the required 97.0%" in runs["fallback"], runs
    table_text = fleet_text(["status"], broker, capsys)
    assert "RUNS (precision, engine)" in table_text
    assert "cls=fp32 built, int8 asked" in table_text, table_text
    assert f"{devices[0]}: slot cls runs fp32, int8 asked: INT8 accuracy guard: " in table_text

    # `fleet cmd DEV status`: the device's own account, the precision asked read as asked.
    capsys.readouterr()
    assert main(["fleet", "cmd", devices[0], "status", "--broker", f"{broker.host}:{broker.port}"]) == 0
    reply = json.loads(capsys.readouterr().out)
    slot_runs = reply["result"]["slots"]["cls"]["runs"]
    assert (slot_runs["requested"], slot_runs["precision"]) == ("int8", "fp32"), slot_runs
    assert reply["result"]["state"]["slots"]["cls"]["active"]["build"]["precision"] == "int8"

    # The controller's /metrics: one series per slot, 1 on a fallback.
    metrics = controller.get("/metrics")[1].decode()
    for device in devices:
        series = (
            f'edge_slot_precision_fallback{{device="{device}",slot="cls",requested="int8",'
            f'precision="fp32",source="built"}} 1.0'
        )
        assert series in metrics, [line for line in metrics.splitlines() if "precision" in line]

    # The console: the device page's slot and the rollouts page's precision box.
    page.goto(f"{controller.url}/device/{devices[0]}")
    runs_cell = page.locator("#slots td.runs.fallback")
    runs_cell.wait_for(timeout=patient_ms(30_000))
    assert runs_cell.inner_text() == "fp32 built, int8 asked"
    assert "runs fp32, int8 asked: INT8 accuracy guard: " in page.locator("#slots").inner_text()
    page.goto(controller.url + "/rollouts")
    head = page.locator(f'section[data-rollout="{ROLLOUT}"] .precision-head.fallback')
    head.wait_for(timeout=patient_ms(30_000))
    assert head.inner_text() == "int8 asked; running fp32 2 (built 2); 2 devices fell back"
    reasons = page.locator(f'section[data-rollout="{ROLLOUT}"] .precision .fallback-reason')
    assert reasons.count() == 2

    # The same rollout asking the gate to count a fallback: the first device's stops it.
    strict = {**body, "rollout_id": f"{ROLLOUT}-strict", "version": "3-int8", "precision_fallback": "fail"}
    with ControllerClient(operator_settings(broker), timeout=30) as client:
        client.request("start", strict)

    def strict_ended() -> bool:
        state: str = fleet_json(["rollout", "status", strict["rollout_id"]], broker, capsys)["state"]
        return state not in ("RUNNING", "PAUSED")

    wait_until(strict_ended, timeout=300, what="the strict INT8 rollout to end")
    stopped = fleet_json(["rollout", "status", strict["rollout_id"]], broker, capsys)
    assert stopped["state"] == "ABORTED", stopped
    assert "run another precision than asked" in stopped["reason"], stopped["reason"]
    (problem, *_) = stopped["problem_devices"]
    assert (problem["end"], problem["figure"]) == ("UNHEALTHY", "runs fp32, int8 asked")
