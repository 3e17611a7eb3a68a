"""``fleet rollout start`` against a real controller and a real mosquitto: the requests it sends.

A probe on the controller's request topics counts them: one ``start``, and only when the controller
answers ``model_not_uploaded``, one ``upload`` and the ``start`` again. The fleet's retained state is
read once, for ``--select`` and the slot's model id alike; the controller's words do not matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import agent.fleet.devices.targets
import agent.fleet.view.status
from agent.demo.broker import Broker
from agent.fleet.controller import start_request
from agent.fleet.controller.requests import ModelNotUploadedError
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fleet.view.status import DeviceRow
from agent.mqtt.settings import MqttSettings
from tests.fleet.controller.test_process import SLOT, Running, _fleet, _wait_state, controller, keys, prefix
from tests.fleet.operator_side import operator_settings, tiny_model
from tests.mqtt_probe import Probe

#: The controller test module's fixtures, used here by name.
__all__ = ["controller", "keys", "prefix"]


@pytest.fixture
def fleet_reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each read of the fleet's retained state by the CLI (the controller keeps its own binding)."""
    reads: list[float] = []
    collect = agent.fleet.view.status.collect_fleet

    def counted(settings: MqttSettings, **kwargs: float) -> list[DeviceRow]:
        reads.append(kwargs.get("max_wait_s", 0.0))
        return collect(settings, **kwargs)

    monkeypatch.setattr(agent.fleet.view.status, "collect_fleet", counted)
    monkeypatch.setattr(agent.fleet.devices.targets, "collect_fleet", counted)
    return reads


def _start(
    broker: Broker, prefix: str, model: Path, rollout_id: str, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """Run ``fleet rollout start`` (``--select``, no ``--model-id``); the controller verbs it asked."""
    from agent.cli import main

    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    # Not a fault test: what is counted is the CLI's requests to the controller, not a device's guards.
    start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]
    start += ["--select", "!site", "--id", rollout_id, "--retained-wait", "1", "--json", *broker_args]
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/_controller/req/#")
        probe.subscribe(f"{prefix}/_probe/mark")
        assert main(start) == 0
        # The broker had every request before the CLI returned: once the mark is back, so are they.
        probe.publish(f"{prefix}/_probe/mark", b"", qos=1)
        probe.wait_for(lambda seen: any(m.topic.endswith("/_probe/mark") for m in seen))
        asked = [m.topic.rsplit("/", 1)[-1] for m in probe.snapshot() if "/_controller/req/" in m.topic]
    assert json.loads(capsys.readouterr().out)["rollout_id"] == rollout_id
    done = _wait_state(operator_settings(broker, prefix), rollout_id, "DONE", "ABORTED")
    assert done["state"] == "DONE", done
    return asked


def test_rollout_start_asks_once_and_uploads_only_when_the_controller_says_the_model_is_missing(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    fleet_reads: list[float],
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, ["k0", "k1"]):
        assert _start(broker, prefix, model, "first", capsys) == ["start", "upload", "start"]
        assert len(fleet_reads) == 1
        # The model is in the controller's repository now: one request, nothing uploaded.
        assert _start(broker, prefix, model, "second", capsys) == ["start"]
        assert len(fleet_reads) == 2


def test_rollout_start_acts_on_the_error_code_not_on_the_words(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    fleet_reads: list[float],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Reworded(ModelNotUploadedError):
        def __init__(self, message: str) -> None:
            super().__init__("das Modell fehlt im Lager des Controllers")

    monkeypatch.setattr(start_request, "ModelNotUploadedError", Reworded)
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, ["k0", "k1"]):
        assert _start(broker, prefix, model, "reworded", capsys) == ["start", "upload", "start"]
    assert len(fleet_reads) == 1
