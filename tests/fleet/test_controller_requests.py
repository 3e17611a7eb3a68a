"""The controller's request API at its edges, against a real mosquitto: a verb it does not know, a
late device under ``on_timeout: wait``, what ``fleet rollout start`` sends.

The controller is the real one (a thread runs its loop, :class:`tests.fleet.test_controller.Running`);
the devices are :mod:`tests.fleet.scripted_fleet` stand-ins for a simulated fleet's devices.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.keys import KeyPairFiles
from agent.localbroker import Broker
from agent.protocol.topics import CONTROLLER_VERBS, ControllerTopics, Topics
from tests.fleet.operator_side import tiny_model
from tests.fleet.test_controller import SLOT, Running, _fleet, controller, keys, prefix
from tests.mqtt_probe import Probe

__all__ = ["controller", "keys", "prefix"]  # fixtures this module's tests use


def test_an_unknown_verb_is_answered_unknown_verb_naming_the_known_ones(
    broker: Broker, prefix: str, controller: Running
) -> None:
    topics = ControllerTopics(prefix)
    reply_topic = topics.reply(uuid.uuid4().hex)
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(reply_topic)
        probe.publish(
            f"{prefix}/_controller/req/frobnicate", b"{}", response_topic=reply_topic, correlation_data=b"c-1"
        )
        probe.publish(
            f"{prefix}/_controller/req/status",
            b"[1]",
            response_topic=reply_topic,
            correlation_data=b"c-2",
        )
        replies = probe.wait_for_count(reply_topic, 2, timeout=30)
    by_correlation = {m.correlation_data: json.loads(m.payload) for m in replies}
    unknown = by_correlation[b"c-1"]
    assert unknown["ok"] is False
    assert unknown["error_code"] == "unknown_verb"
    assert unknown["command"] == "frobnicate"
    assert unknown["error"] == f"unknown controller verb frobnicate; known: {', '.join(CONTROLLER_VERBS)}"
    # A known verb with a bad payload stays bad_request: the two mistakes are told apart.
    assert by_correlation[b"c-2"]["error_code"] == "bad_request"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    shown_in_doc = ", ".join(
        f'"{k}": {json.dumps(unknown[k])}' for k in ("command", "ok", "error_code", "error")
    )
    assert shown_in_doc in " ".join(doc.split()), "docs/protocol.md shows another unknown_verb reply"


def test_rollout_start_keeps_the_nulls_of_shadow_and_probation_in_the_manifest_the_device_gets(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``min_agreement: null`` (a model whose classes changed) and a disabled probation bar reach the
    device as null, not as their defaults (0.9, 0.5)."""
    model = tiny_model(tmp_path / "m.onnx")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    desired = Topics(prefix, "n0").desired(SLOT)
    with _fleet(broker, prefix, keys, ["n0"]) as fleet, Probe(broker.host, broker.port) as device:
        device.subscribe(desired)
        argv = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--device", "n0"]
        argv += ["--shadow-json", '{"min_agreement": null, "frames": 6}', "--probation-s", "5"]
        argv += ["--probation-json", '{"max_class_shift": null}', "--id", "nulls", "--wait", *broker_args]
        assert main(argv) == 0, capsys.readouterr()
        manifest = json.loads(json.loads(device.wait_for_count(desired, 1)[0].payload)["manifest"])
        assert fleet.jobs()["n0"] != []
    assert manifest["shadow"]["min_agreement"] is None
    assert manifest["shadow"]["frames"] == 6
    assert manifest["probation"]["max_class_shift"] is None
    assert manifest["probation_s"] == 5
