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
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from agent.cli import main
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of, make_key
from agent.fsutil import sha256_file
from agent.protocol.topics import Topics, trust_root
from tests.e2e.daemon import AgentFiles, unique_results
from tests.e2e.fleet_rig import Fleet, agent_state, count_version, job_statuses
from tests.e2e.test_precision_fallback import fleet_json
from tests.e2e.test_rollout_rollback import cli, rollout_status, serving, start, wait_state
from tests.e2e.test_trust import _deploy, _release
from tests.fleet.console import test_browser
from tests.fleet.controller_process import ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

browser = test_browser.browser
page = test_browser.page


def _rooted(fleet: Fleet, probe: Probe, tmp_path: Path, device_id: str) -> tuple[Path, AgentFiles, str]:
    """A fleet root made offline, and a started device that holds it, serving cls 1: the trust
    directory, the device's files and its results topic."""
    trust = tmp_path / "trust"
    versions.init(trust, root_keys=3, threshold=2, expires_days=30)
    files = fleet.files(device_id, trust_root=str(trust / "root" / "1.root.json"))
    fleet.start(files)
    topic = Topics("fleet/v1", device_id).results("cam")
    probe.wait_for(count_version("1", topic), timeout=180)
    return trust, files, topic


def _serving_released_v2(
    fleet: Fleet, broker: Broker, probe: Probe, tmp_path: Path, device_id: str
) -> tuple[Path, AgentFiles, str]:
    """:func:`_rooted`, then cls 2 released with the release key and deployed (`fleet deploy --release`)."""
    trust, files, topic = _rooted(fleet, probe, tmp_path, device_id)
    assert _deploy(broker, trust, files.v2, "2", _release(trust, files.v2, "2"), [device_id]) == 0
    return trust, files, topic


def test_an_aborted_rollout_on_a_rooted_fleet_goes_back_with_the_previous_release(
    fleet: Fleet,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trust, files, topic = _rooted(fleet, probe, tmp_path, device_id)
    key = trust / "keys" / "controller.key"
    (tmp_path / "controller").mkdir()
    signer = KeyPairFiles(key_id=key_id_of(key), private=key, public=key.with_suffix(".pub"), fingerprint="")
    controller = ControllerProcess(tmp_path / "controller", broker, "fleet/v1", keys=signer).start()
    try:
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
    _trust, files, topic = _serving_released_v2(fleet, broker, probe, tmp_path, device_id)
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


def _slot_info(probe: Probe, device_id: str, since: int = 0) -> dict[str, Any]:
    """Slot ``cls`` of the device's newest ``up/info`` among the probe's messages from ``since`` on
    (``{"model": {}}`` when there is none)."""
    infos = [m for m in probe.snapshot()[since:] if m.topic == Topics("fleet/v1", device_id).info]
    return dict(json.loads(infos[-1].payload)["slots"]["cls"]) if infos else {"model": {}}


def _serving_since(probe: Probe, topic: str, since: int, version: str) -> bool:
    """Results of model ``version`` among the probe's messages from ``since`` on."""
    return sum(r.model.version == version for r in unique_results(probe.snapshot()[since:], topic)) >= 3


def _revoke_release_key(trust: Path) -> Path:
    """Offline: root 2 adds ``release-2``, root 3 revokes ``release``; each signed by two root keys."""
    keys = trust / "keys"
    new = make_key(keys, "release-2")
    versions.rotate(trust, role="release", add=[new.public], remove=[], threshold=None, expires_days=30)
    versions.sign(trust, keys / "root-1.key")
    versions.sign(trust, keys / "root-2.key")
    versions.revoke(trust, key_id_of(keys / "release.pub"), expires_days=30)
    versions.sign(trust, keys / "root-2.key")
    versions.sign(trust, keys / "root-3.key")
    return new.private


def test_a_model_serving_under_a_revoked_release_key_is_flagged_keeps_serving_and_clears_once_re_released(
    fleet: Fleet,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    page: Page,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trust, files, topic = _serving_released_v2(fleet, broker, probe, tmp_path, device_id)
    (tmp_path / "controller").mkdir()
    controller = ControllerProcess(tmp_path / "controller", broker, "fleet/v1").start()
    try:
        wait_until(lambda: _slot_info(probe, device_id).get("model", {}).get("version") == "2", timeout=60,
                   what="up/info with cls 2")  # fmt: skip
        assert "release_revoked" not in _slot_info(probe, device_id)
        _revoke_release_key(trust)
        publish = [
            "fleet",
            "trust",
            "publish",
            "--dir",
            str(trust),
            "--broker",
            f"{broker.host}:{broker.port}",
        ]
        assert main(publish) == 0
        wait_until(lambda: "release_revoked" in _slot_info(probe, device_id), timeout=60,
                   what="up/info flagging the model released under the revoked key")  # fmt: skip
        flagged = _slot_info(probe, device_id)
        assert flagged["model"]["version"] == "2"
        assert "revoked by fleet root version 3" in flagged["release_revoked"], flagged
        flagged_at = len(probe.snapshot())  # it keeps serving the flagged model
        wait_until(lambda: _serving_since(probe, topic, flagged_at, "2"), timeout=60, what="cls 2 serving")

        rows = {r["device"]: r for r in fleet_json(["status"], broker, capsys)}
        assert "revoked by fleet root version 3" in rows[device_id]["slots"]["cls"]["release_revoked"]
        capsys.readouterr()
        assert main(["fleet", "status", "--broker", f"{broker.host}:{broker.port}"]) == 0
        table = capsys.readouterr().out
        assert "cls=cls:2 (revoked key)" in table, table
        assert f"{device_id}: slot cls serves a model released under key" in table, table
        wait_until(
            lambda: "release_revoked" in controller.json(f"/api/device/{device_id}")["slots"]["cls"],
            timeout=60,
            what="the console's device page flagging it",
        )
        page.goto(f"{controller.url}/device/{device_id}")
        expect(page.locator("#slots")).to_contain_text("revoked key: released under key")
        page.goto("about:blank")  # its live updates end before the controller does

        # Re-released with the new release key and deployed: the flag clears.
        again = _release(trust, files.v2, "2", key="release-2.key")
        redeployed_at = len(probe.snapshot())
        assert _deploy(broker, trust, files.v2, "2", again, [device_id]) == 0
        wait_until(
            lambda: (
                _slot_info(probe, device_id, redeployed_at)["model"].get("version") == "2"
                and "release_revoked" not in _slot_info(probe, device_id, redeployed_at)
            ),
            timeout=60,
            what="up/info of cls 2 without the flag",
        )
    finally:
        controller.kill()
        probe.publish(trust_root("fleet/v1"), b"", retain=True)
    for daemon in fleet.daemons:
        assert daemon.stop() == 0, daemon.log()[-3000:]
