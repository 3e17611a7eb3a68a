"""A rollout shares engines by its flag, else the controller's ``engines.share`` (on): the real
controller and mosquitto, the decision signed into every device's manifest as ``share_engines``.

The devices are :mod:`tests.fleet.scripted_fleet` stand-ins (they check signatures as the agent
does); what an agent does with the flag is tests/e2e/test_fleet_engines.py's subject.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles
from agent.protocol.manifest import parse_signed
from agent.signing import load_public_key
from tests.fleet.controller.test_process import SLOT, Running, _fleet, _wait_state, controller, keys, prefix
from tests.fleet.operator_side import operator_settings, tiny_model
from tests.mqtt_probe import Probe

#: The controller test module's fixtures, used here by name.
__all__ = ["controller", "keys", "prefix"]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("flag", "shared"), [([], True), (["--no-share-engines"], None)], ids=["default", "off"]
)
def test_a_rollouts_manifests_say_whether_devices_share_engines(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
    flag: list[str],
    shared: bool | None,
) -> None:
    from agent.cli import main

    model = tiny_model(tmp_path / "m.onnx")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with _fleet(broker, prefix, keys, ["k0"]), Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/+/down/desired/{SLOT}")
        # Not a fault test: what is checked is the signed manifest, not a device's checks.
        start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]
        start += ["--device", "k0", "--id", "share", *flag]
        assert main([*start, "--json", *broker_args]) == 0
        assert json.loads(capsys.readouterr().out)["rollout_id"] == "share"
        assert _wait_state(operator_settings(broker, prefix), "share", "DONE", "ABORTED")["state"] == "DONE"
        (desired,) = [m for m in probe.snapshot() if m.topic.endswith(f"/down/desired/{SLOT}")]
    manifest = parse_signed(desired.payload, {keys.key_id: load_public_key(keys.public)}, True, "k0")
    assert manifest.share_engines is shared
    # As docs/engines.md says: a rollout that does not share leaves the key out (older agents).
    signed_text = json.loads(desired.payload)["manifest"]  # the manifest's own JSON, as signed
    assert ("share_engines" in json.loads(signed_text)) is bool(shared)
    doc = " ".join((REPO / "docs" / "engines.md").read_text(encoding="utf-8").split())
    assert "a rollout that does not share leaves the key out" in doc
