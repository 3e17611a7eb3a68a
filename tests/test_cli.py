"""``python -m agent`` as a real subprocess: check-config, schema, info, --version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from agent import __version__
from agent.cli import EXIT_CLOSED_PIPE
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.protocol.messages import MESSAGE_MODELS, StatusMessage, encode
from agent.protocol.topics import Topics
from agent.schemas import EVERY_MESSAGE
from tests.mqtt_probe import Probe
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[1]


def agent_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT__")}
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_classifier(tmp_path_factory.mktemp("cli") / "cls.onnx", input_size=32, num_classes=4)


def test_check_config_names_every_problem_with_its_key_path(tmp_path: Path, model: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "device_id": "bad id!",
                "mqtt": {"port": 70000, "bogus": 1},
                "slots": {"cls": {"model": str(tmp_path / "missing.onnx"), "max_batch": 0}},
                "streams": {"cam": {"source": {"type": "synthetic"}, "slot": "nosuch"}},
                "telemetry": {"interval_s": -1},
            }
        )
    )
    proc = agent_cli("check-config", "-c", str(bad))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    expected = {
        "device_id": "not a valid name",
        "mqtt.bogus": "unknown key",
        "mqtt.port": "less than 65536",
        "slots.cls.max_batch": "greater than or equal to 1",
        "slots.cls.model": "file not found",
        "streams.cam.slot": "no slot named 'nosuch'",
        "telemetry.interval_s": "greater than 0",
    }
    for key, problem in expected.items():
        hits = [line for line in lines if line.startswith(f"{bad}: {key}: ")]
        assert hits, f"{key} not reported in:\n{proc.stderr}"
        assert problem in hits[0]
    assert len(lines) == len(expected), proc.stderr
    assert "ok" not in proc.stdout


def test_check_config_reports_yaml_syntax_errors_with_the_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("device_id: dev\nmqtt:\n  port: [1883\n")
    proc = agent_cli("check-config", "-c", str(broken))
    assert proc.returncode == 1
    assert "YAML syntax error at line" in proc.stderr
    missing = agent_cli("check-config", "-c", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "file not found" in missing.stderr


def test_check_config_accepts_a_good_config(tmp_path: Path, model: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        yaml.safe_dump(
            {
                "device_id": "dev-1",
                "state_dir": str(tmp_path / "state"),
                "slots": {"cls": {"model": model.name, "preprocess": {"width": 32, "height": 32}}},
                "streams": {"cam": {"source": {"type": "synthetic"}, "slot": "cls"}},
            }
        )
    )
    model_copy = tmp_path / model.name  # relative model paths are read from the config's folder
    model_copy.write_bytes(model.read_bytes())
    proc = agent_cli("check-config", "-c", str(good))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{good}: ok"
    assert proc.stderr == ""
    # The form docs/configuration.md and the example config's header show: the file as an argument.
    positional = agent_cli("check-config", str(good))
    assert (positional.returncode, positional.stdout.strip(), positional.stderr) == (0, f"{good}: ok", "")
    both = agent_cli("check-config", str(good), "-c", str(good))
    assert both.returncode == 0, both.stderr


def test_check_config_takes_one_file(tmp_path: Path) -> None:
    none = agent_cli("check-config")
    assert none.returncode == 2
    assert "give the config file: edge-agent check-config FILE" in none.stderr
    two = agent_cli("check-config", str(tmp_path / "a.yaml"), "-c", str(tmp_path / "b.yaml"))
    assert two.returncode == 2
    assert "two config files given" in two.stderr
    missing = agent_cli("check-config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "file not found" in missing.stderr


def test_schema_writes_one_valid_schema_per_message_and_the_deploy_manifest(tmp_path: Path) -> None:
    out = tmp_path / "schemas"
    proc = agent_cli("schema", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    # The README says "every MQTT message": what the operator publishes on down/desired is one too.
    # The chunk request and the controller's request and status too (issue 22.12).
    models: tuple[type[BaseModel], ...] = EVERY_MESSAGE
    assert {*MESSAGE_MODELS, SignedManifest, DeployManifest} < set(models)
    names = {f"{m.__name__}.schema.json" for m in models}
    assert {p.name for p in out.iterdir()} == names
    assert {Path(line).name for line in proc.stdout.split()} == names
    for model in models:
        schema = json.loads((out / f"{model.__name__}.schema.json").read_text())
        assert schema["title"] == model.__name__
        assert schema["type"] == "object"
        assert set(schema["properties"]) == set(model.model_fields)


def test_info_json_describes_platform_and_backends() -> None:
    proc = agent_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert set(info) == {"platform", "backends"}
    assert info["platform"]["machine"]
    assert info["platform"]["is_jetson"] is False
    usable, reason = info["backends"]["onnxruntime"]
    assert usable is True
    assert "ONNX Runtime" in reason
    trt_usable, trt_reason = info["backends"]["tensorrt"]
    assert trt_usable is False  # only the type stubs are installed here
    assert trt_reason


def test_version_and_usage_errors() -> None:
    proc = agent_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"edge-agent {__version__}"
    usage = agent_cli("run")  # -c is required
    assert usage.returncode == 2
    assert "-c/--config" in usage.stderr


def _with_closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agent ARGS`` whose stdout's reader is already gone, as after ``| head -2``."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "agent", *args],
            cwd=REPO,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=patient(60),
            check=False,
        )
    finally:
        os.close(write_end)


def test_a_closed_pipe_ends_quietly(broker: Broker) -> None:
    prefix = f"closed/pipe-{uuid.uuid4().hex[:8]}"
    # One device, so `fleet status` has a table to write (an empty prefix is an error: stderr, exit 1).
    status = StatusMessage(state="online", session=1, agent_version="0.3.1")
    with Probe(broker.host, broker.port) as probe:
        probe.publish(Topics(prefix, "jet-01").status, encode(status), retain=True)
        _closed_pipe_cases(broker, prefix)
        probe.publish(Topics(prefix, "jet-01").status, b"", retain=True)


def _closed_pipe_cases(broker: Broker, prefix: str) -> None:
    for args in (
        ("info",),
        (
            "fleet",
            "status",
            "--broker",
            f"{broker.host}:{broker.port}",
            "--prefix",
            prefix,
            "--retained-wait",
            "2",
            "--telemetry-wait",
            "0",
        ),
    ):
        proc = _with_closed_stdout(*args)
        assert proc.returncode == EXIT_CLOSED_PIPE, (args, proc.stderr)
        assert proc.stderr == "", (args, proc.stderr)


def test_a_missing_config_file_is_named_once(tmp_path: Path) -> None:
    missing = tmp_path / "x.yaml"
    for command in ("check-config", "run"):
        proc = agent_cli(command, "-c", str(missing))
        assert proc.returncode == 1
        assert proc.stderr.count(str(missing)) == 1, proc.stderr
        assert "file not found" in proc.stderr
