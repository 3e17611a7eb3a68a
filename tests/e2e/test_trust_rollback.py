"""End to end: the ways back on a fleet with a root of trust, real processes and a real mosquitto.

A rooted device refuses any desired state that names no release, a way back included. The
controller's way back therefore carries the previous model's own signed release, which it kept with
the rollout that deployed it; and the device's own ``rollback`` command puts back the model already
on its disk (checked when it was installed). Shadow and probation are on, as users run them, judging
job ends only (fleet_rig).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of
from agent.fsutil import sha256_file
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles
from tests.e2e.fleet_rig import Fleet, agent_state, count_version, job_statuses
from tests.e2e.test_rollout_rollback import cli, rollout_status, serving, start, wait_state
from tests.e2e.test_trust import _deploy, _release
from tests.fleet.controller_process import ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _rooted(fleet: Fleet, tmp_path: Path, device_id: str) -> tuple[Path, AgentFiles]:
    """A fleet root made offline, and the files of a started device that holds it (serving cls 1)."""
    trust = tmp_path / "trust"
    versions.init(trust, root_keys=3, threshold=2, expires_days=30)
    files = fleet.files(device_id, trust_root=str(trust / "root" / "1.root.json"))
    fleet.start(files)
    return trust, files


def test_an_aborted_rollout_on_a_rooted_fleet_goes_back_with_the_previous_release(
    fleet: Fleet,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trust, files = _rooted(fleet, tmp_path, device_id)
    key = trust / "keys" / "controller.key"
    (tmp_path / "controller").mkdir()
    signer = KeyPairFiles(key_id=key_id_of(key), private=key, public=key.with_suffix(".pub"), fingerprint="")
    controller = ControllerProcess(tmp_path / "controller", broker, "fleet/v1", keys=signer).start()
    try:
        topic = Topics("fleet/v1", device_id).results("cam")
        probe.wait_for(count_version("1", topic), timeout=180)
        v2 = files.v2
        start(broker, v2, [device_id], "r-v2", "2", release=_release(trust, v2, "2").read_text())
        assert wait_state(broker, "r-v2", "DONE", "ABORTED")["state"] == "DONE"
        v3 = write_classifier(tmp_path / "cls-v3.onnx", input_size=32, num_classes=4, seed=3)
        release = _release(trust, v3, "3").read_text()
        start(broker, v3, [device_id], "r-v3", "3", soak_s=3600.0, release=release)
        wait_until(
            lambda: rollout_status(broker, "r-v3")["waves"][0]["state"] == "SOAKING",
            timeout=240,
            what="r-v3's wave soaking",
        )
        code, _out, _err = cli(broker, capsys, "rollout", "abort", "r-v3", "--rollback")
        assert code == 0
        wait_until(
            lambda: (rollout_status(broker, "r-v3").get("rollback") or {}).get("ends") is not None,
            timeout=180,
            what="r-v3's rollback at its end",
        )
        # The way back named v2's release, which the device verified against its root: it runs v2.
        way_back = job_statuses(probe, f"r-v3-rollback-{sha256_file(v2)[:8]}", device_id)
        ended = [(s.state.value, s.error_code) for s in way_back if s.state.terminal]
        assert ended == [("ACTIVE", None)], ended
        state = agent_state(files)["slots"]["cls"]
        assert (state["active"]["version"], state["active"]["origin"]) == ("2", "rollback")
        probe.clear()
        probe.wait_for(count_version("2", topic), timeout=60)
    finally:
        controller.kill()
    for daemon in fleet.daemons:
        assert daemon.stop() == 0, daemon.log()[-3000:]


def test_a_rooted_devices_own_rollback_puts_back_the_model_on_its_disk(
    fleet: Fleet,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trust, files = _rooted(fleet, tmp_path, device_id)
    topic = Topics("fleet/v1", device_id).results("cam")
    probe.wait_for(count_version("1", topic), timeout=180)
    assert _deploy(broker, trust, files.v2, "2", _release(trust, files.v2, "2"), [device_id]) == 0
    assert serving(files) == "2"

    # No desired state and no release: the command names the slot; the model is the one on disk.
    code, out, _err = cli(broker, capsys, "cmd", device_id, "rollback", "--args", '{"slot": "cls"}')
    assert code == 0, out
    assert json.loads(out)["result"]["model"]["version"] == "1", out
    assert agent_state(files)["slots"]["cls"]["active"]["origin"] == "rollback"
    probe.clear()
    probe.wait_for(count_version("1", topic), timeout=60)
    for daemon in fleet.daemons:
        assert daemon.stop() == 0, daemon.log()[-3000:]
