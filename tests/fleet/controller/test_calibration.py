"""``fleet rollout start --calib-cache FILE`` against a real controller and a real mosquitto: the
calibration is uploaded into the controller's repository beside the model and signed into every
device's manifest as the artifact the INT8 build names.

The devices are :mod:`tests.fleet.scripted_fleet` stand-ins (they check signatures as the agent
does); what an agent does with the artifact is tests/e2e/test_calibration_artifact.py's subject.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fsutil import sha256_file
from agent.model_contract.calibration_table import write_table
from agent.protocol.manifest import parse_signed
from agent.signing import load_public_key
from tests.fleet.controller.test_process import SLOT, Running, _fleet, _wait_state, controller, keys, prefix
from tests.fleet.operator_side import operator_settings, tiny_model
from tests.mqtt_probe import Probe

#: The controller test module's fixtures, used here by name.
__all__ = ["controller", "keys", "prefix"]


def test_rollout_start_uploads_the_calibration_and_signs_it_into_the_manifest(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.cli import main

    model = tiny_model(tmp_path / "m.onnx")
    table = tmp_path / "calibration.json"
    write_table(table, {"x": (-1.0, 1.0)}, method="entropy")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with _fleet(broker, prefix, keys, ["k0", "k1"]) as fleet, Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/+/down/desired/{SLOT}")
        # Not a fault test: what is checked is the CLI's output / the signed manifest, not a device's
        # checks (the fault tests run with shadow and probation on: tests/fleetsim/test_controller_faults.py).
        start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]
        start += ["--device", "k0,k1", "--precision", "int8", "--calib-cache", str(table), "--id", "cal"]
        assert main([*start, "--json", *broker_args]) == 0
        assert json.loads(capsys.readouterr().out)["rollout_id"] == "cal"
        done = _wait_state(operator_settings(broker, prefix), "cal", "DONE", "ABORTED")
        assert done["state"] == "DONE", done
        desired = [m for m in probe.snapshot() if m.topic.endswith(f"/down/desired/{SLOT}")]
        assert {m.topic.split("/")[-4] for m in desired} == {"k0", "k1"}
        assert all(len(jobs) == 1 for jobs in fleet.jobs().values())
    trusted = {keys.key_id: load_public_key(keys.public)}
    for message in desired:
        manifest = parse_signed(message.payload, trusted, True, message.topic.split("/")[-4])
        assert manifest.build is not None
        assert manifest.build.calibration is not None
        assert manifest.build.calibration.artifact == "calibration"
        assert manifest.artifact("calibration").sha256 == sha256_file(table)
    # In the repository by its hash, where the controller's chunk server answers for it.
    repo = tmp_path / "controller" / "models"
    assert (repo / f"{sha256_file(table)}.onnx").read_bytes() == table.read_bytes()
