"""``fleet rollout start --release FILE`` against a real controller and a real mosquitto: the release
travels beside every device's manifest, and a device with the fleet root whose controller key is the
controller's accepts the desired state the controller signed.

The devices are :mod:`tests.fleet.scripted_fleet` stand-ins; the root's check runs here on what they
received (what an agent does with it: tests/e2e/test_trust.py, tests/delivery/test_fleet_root.py).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of
from agent.fleet.trust.versions import TrustDir
from agent.trust.deployment import check_desired
from tests.fleet.controller.test_process import SLOT, Running, _fleet, _wait_state, controller, prefix
from tests.fleet.operator_side import operator_settings, tiny_model
from tests.mqtt_probe import Probe

#: The controller test module's fixtures, used here by name.
__all__ = ["controller", "prefix"]


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    """The controller's key pair, known to devices by its TUF key id (what a fleet root names it by)."""
    made = write_keypair(tmp_path / "keys", "controller")
    return dataclasses.replace(made, key_id=key_id_of(made.public))


def test_a_rollout_carries_the_release_and_its_desired_states_pass_the_fleet_root(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.cli import main

    trust = tmp_path / "trust"
    versions.init(trust, root_keys=1, threshold=1, expires_days=30)
    # The controller's own key becomes the root's controller key (the controller signs with it).
    versions.rotate(trust, role="controller", add=[keys.public], remove=[], threshold=None, expires_days=30)
    versions.sign(trust, trust / "keys" / "root-1.key")
    root = TrustDir(trust).newest()
    model = tiny_model(tmp_path / "m.onnx")
    release = tmp_path / "m.release.json"
    argv = ["fleet", "trust", "release", str(model), "--key", str(trust / "keys" / "release.key")]
    assert main([*argv, "--out", str(release), "--model-id", "m", "--version", "2"]) == 0
    capsys.readouterr()
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with _fleet(broker, prefix, keys, ["r0", "r1"]), Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/+/down/desired/{SLOT}")
        # Not a fault test: what is checked is the signed desired state, not a device's guards.
        start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]
        start += ["--model-id", "m", "--device", "r0,r1", "--release", str(release), "--id", "rel"]
        assert main([*start, "--json", *broker_args]) == 0
        assert json.loads(capsys.readouterr().out)["rollout_id"] == "rel"
        done = _wait_state(operator_settings(broker, prefix), "rel", "DONE", "ABORTED")
        assert done["state"] == "DONE", done
        desired = [m for m in probe.snapshot() if m.topic.endswith(f"/down/desired/{SLOT}")]
    assert {m.topic.split("/")[-4] for m in desired} == {"r0", "r1"}
    for message in desired:
        device = message.topic.split("/")[-4]
        manifest = check_desired(root, message.payload, device, datetime.now(timezone.utc))
        assert (manifest.model_id, manifest.version) == ("m", "2")
