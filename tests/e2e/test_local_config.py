"""configs/local.yaml as a new user runs it: ``edge-agent broker``, ``edge-agent run -c
configs/local.yaml`` and ``edge-agent fleet watch local-01``, each a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import load_config
from agent.datasets.shapes import CLASSES
from agent.demo.broker import Broker, free_port
from tests.e2e.daemon import REPO, Daemon
from tests.waiting import patient

LOCAL = REPO / "configs" / "local.yaml"


def _edge_agent(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_local_config_names_the_bundled_model_and_a_state_dir_in_the_checkout() -> None:
    config = load_config(LOCAL)
    assert config.slots["shapes"].model.resolve() == REPO / "agent" / "assets" / "shapes_classifier.onnx"
    assert config.state_dir.resolve() == REPO / ".local-state"
    assert (config.mqtt.host, config.mqtt.port) == ("127.0.0.1", 1883)


@pytest.fixture(params=["free", "system broker"])
def broker_port(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[int]:
    """``edge-agent broker`` on a free port (1883 may be taken on a test machine), or on a port where a
    broker already runs, as Debian's mosquitto package runs one on 1883: it starts nothing, says so
    and exits 0, and the flow goes on unchanged."""
    if request.param == "system broker":
        with Broker(tmp_path / "system-mosquitto") as system:
            first = _edge_agent("broker", "--port", str(system.port))
            out, err = first.communicate(timeout=patient(30))
            assert first.returncode == 0, err
            assert out.startswith(f"127.0.0.1:{system.port} already has an MQTT broker"), out
            yield system.port
        return
    port = free_port()
    proc = _edge_agent("broker", "--port", str(port))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(f"mosquitto listening on 127.0.0.1:{port}"), line + (
        proc.stderr.read() if proc.stderr else ""
    )
    yield port
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=patient(15))
    assert proc.returncode == 0, err
    assert "mosquitto stopped" in out


@pytest.mark.slow
def test_the_agent_runs_on_local_yaml_and_fleet_watch_shows_its_results(
    tmp_path: Path, broker_port: int
) -> None:
    # Only the port (the broker's) and the state dir (not the checkout) differ from the file.
    env = {"EDGE_AGENT__MQTT__PORT": str(broker_port), "EDGE_AGENT__STATE_DIR": str(tmp_path / "state")}
    broker = ["--broker", f"127.0.0.1:{broker_port}", "--duration", "60"]
    daemon = Daemon(LOCAL, tmp_path / "agent.log", env=env)
    try:
        watch = subprocess.run(
            [sys.executable, "-m", "agent", "fleet", "watch", "local-01", "--json", "--count", "8", *broker],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=patient(90),
            check=False,
        )
    finally:
        code = daemon.stop(timeout=15)
    assert watch.returncode == 0, watch.stderr
    assert code == 0, daemon.log()[-3000:]
    documents = [json.loads(line) for line in watch.stdout.splitlines()]
    results = [d["payload"] for d in documents if d["kind"] == "results"]
    assert results, watch.stdout + daemon.log()[-3000:]
    assert {r["model"]["model_id"] for r in results} == {"shapes-classifier"}
    assert all(r["classes"][0]["label"] in CLASSES for r in results)
    assert len(results[0]["classes"]) == 3
