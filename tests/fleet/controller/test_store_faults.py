"""The fleet controller, a real child process, on a damaged store and a full state disk.

A damaged or emptied ``rollouts.sqlite`` stops the controller at start with one line on stderr that
names the file and what to do, exit code 1, no traceback, the file left as it was. A full state disk
(a real 4 MiB tmpfs filled to 0 bytes) costs one warning for the episode and one line when it ends,
no traceback, no partial upload file; once space returns the same process finishes its rollout, with
no restart. A wave whose rows cannot be stored after its publish leaves no deploy connected. Shadow
and probation are on, as operators run rollouts; the devices are :mod:`tests.fleet.scripted_fleet`
(stand-ins for a simulated fleet's devices).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient, RequestRefusedError
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.rollout.records import DeviceStep, RolloutPlan
from agent.fleet.rollout.runner import RolloutRunner
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.store import WAL_LIMIT_BYTES, RolloutStore, StoreFullError
from agent.fsutil import sha256_file
from agent.mqtt.settings import MqttSettings
from agent.signing import load_public_key
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.fleet.rollout.test_store_faults import damage_every_third_page
from tests.fleet.scripted_fleet import ScriptedFleet
from tests.small_disk import small_disk
from tests.waiting import patient, wait_until

ROOT = Path(__file__).resolve().parents[3]
SLOT = "cls"
#: How the rollouts here ask for shadow and probation (on, as operators run them).
GUARDS: dict[str, Any] = {"shadow": {"frames": 30, "min_agreement": 0.9}, "probation_s": 5}


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


def _config(tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, state: Path) -> Path:
    config = tmp_path / "controller.yaml"
    config.write_text(
        f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {prefix}}}\n"
        f"state_dir: {state}\nsigning_key: {keys.private}\nkey_id: {keys.key_id}\n"
        "status_poll_s: 1\nselect_wait_s: 0.5\n"
    )
    return config


def _command(config: Path) -> list[str]:
    return [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(config)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _two_rollouts(path: Path) -> None:
    store = RolloutStore(path)
    for r in range(2):
        devices = [f"jet-{r}-{i:03d}" for i in range(60)]
        store.create(RolloutPlan(f"r{r}", f"s{r}", f"job-{r}", "2", [devices[:5], devices[5:]]))
    store.close()


class ControllerProcess:
    """``edge-agent fleet controller`` as a child process, its console log in a file."""

    def __init__(self, config: Path, log: Path, errors: Path | None = None) -> None:
        """Its stdout (the console log) goes to ``log``, its stderr to ``errors`` (or ``log`` too)."""
        self.log = log
        with log.open("ab") as out, (errors or log).open("ab") as err:
            self.child = subprocess.Popen(
                _command(config), env=_env(), stdout=out, stderr=err if errors else subprocess.STDOUT
            )
        wait_until(
            lambda: "requests on" in self.text() or self.child.poll() is not None,
            timeout=30,
            what="the controller's ready line",
        )
        assert self.child.poll() is None, self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def stop(self) -> int:
        self.child.send_signal(signal.SIGTERM)
        return self.child.wait(patient(30))


@pytest.mark.parametrize("damage", ["every third page", "emptied to 0 bytes"])
def test_a_controller_on_a_damaged_store_exits_with_one_line_naming_the_file(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, damage: str
) -> None:
    state = tmp_path / "state"
    store = state / "rollouts.sqlite"
    _two_rollouts(store)
    if damage == "every third page":
        damage_every_third_page(store, 1)
    else:
        store.write_bytes(b"")
    damaged = store.read_bytes()
    config = _config(tmp_path, broker, unique_prefix(), keys, state)
    done = subprocess.run(
        _command(config), env=_env(), capture_output=True, text=True, timeout=patient(60), check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: rollout store {store} is damaged ("), lines[0]
    assert "move rollouts.sqlite and its -wal and -shm files aside" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert "resumed" not in done.stdout, "the controller started on it"
    assert store.read_bytes() == damaged


def test_damage_met_by_a_running_controller_stops_it_with_one_line(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles
) -> None:
    """The store passed its check at start; then its ``rollouts`` table points at a page that does not
    exist (a damaged schema, committed through SQLite by another writer): the loop's next read meets it."""
    prefix = unique_prefix()
    settings = operator_settings(broker, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    state = tmp_path / "state"
    store = state / "rollouts.sqlite"
    errors = tmp_path / "stderr.txt"
    trusted = {keys.key_id: load_public_key(keys.public)}
    controller = ControllerProcess(
        _config(tmp_path, broker, prefix, keys, state), tmp_path / "controller.log", errors
    )
    try:
        with ScriptedFleet(broker, prefix, ["d0"], slot=SLOT, trusted=trusted) as fleet:
            fleet.set_online("d0", False)  # the rollout stays open: its runner reads the store every step
            _start(settings, model, "open", ["d0"], waves="100%", on_timeout="wait")
            vandal = sqlite3.connect(store, isolation_level=None, timeout=30)
            vandal.execute("PRAGMA writable_schema=ON")
            vandal.execute("UPDATE sqlite_master SET rootpage = 99999 WHERE name = 'rollouts'")
            cookie = vandal.execute("PRAGMA schema_version").fetchone()[0]
            vandal.execute(f"PRAGMA schema_version={cookie + 1}")  # the controller rereads the schema
            vandal.close()
            code = controller.child.wait(patient(30))
    finally:
        if controller.child.poll() is None:
            controller.child.kill()
            controller.child.wait(patient(10))
    stderr = errors.read_text()
    assert code == 1, controller.text()[-3000:] + stderr
    assert stderr.splitlines() == [stderr.strip()], stderr
    assert stderr.startswith(f"error: rollout store {store} is damaged ("), stderr
    assert "malformed" in stderr
    assert "Traceback" not in controller.text() + stderr


def _status(settings: MqttSettings, rollout_id: str) -> dict[str, Any]:
    with ControllerClient(settings, timeout=20) as client:
        return client.request("status", {"rollout_id": rollout_id})


def _ended(settings: MqttSettings, rollout_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def over() -> bool:
        seen.update(_status(settings, rollout_id))
        if seen["state"] in ("DONE", "ABORTED"):
            return True
        time.sleep(0.3)
        return False

    wait_until(over, timeout=90, what=f"rollout {rollout_id} over")
    return seen


def _start(settings: MqttSettings, model: Path, rollout_id: str, devices: list[str], **fields: Any) -> None:
    body = {
        "model_sha256": sha256_file(model),
        "model_name": model.name,
        "slot": SLOT,
        "version": "2",
        "devices": devices,
        "chunk_size": 4096,
        "rollout_id": rollout_id,
        **GUARDS,
        **fields,
    }
    with ControllerClient(settings, timeout=20) as client:
        client.upload(model, body["model_sha256"])
        client.request("start", body)


def _refused(settings: MqttSettings, verb: str, body: dict[str, Any]) -> str:
    with ControllerClient(settings, timeout=20) as client, pytest.raises(RequestRefusedError) as refused:
        client.request(verb, body)
    return refused.value.reason


def test_a_full_state_disk_costs_one_warning_no_upload_debris_and_the_controller_recovers_without_restart(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles
) -> None:
    prefix = unique_prefix()
    settings = operator_settings(broker, prefix)
    names = ["f0", "f1", "f2"]
    model = tiny_model(tmp_path / "m.onnx")
    sha = sha256_file(model)
    big = tmp_path / "big.onnx"
    big.write_bytes(os.urandom(2 * 1024 * 1024))
    trusted = {keys.key_id: load_public_key(keys.public)}
    with small_disk(tmp_path / "disk", "4m") as disk:
        state = disk.path / "state"
        controller = ControllerProcess(
            _config(tmp_path, broker, prefix, keys, state), tmp_path / "controller.log"
        )
        try:
            with ScriptedFleet(broker, prefix, names, slot=SLOT, trusted=trusted) as fleet:
                fleet.set_online("f1", False)  # wave 2 (f1, f2) stays open until f1 is back
                _start(settings, model, "full", names, waves="1,100%", on_timeout="wait")
                wait_until(
                    lambda: _status(settings, "full")["devices"].get("ACTIVE") == 2,
                    timeout=60,
                    what="f0 and f2 ended ACTIVE",
                )
                disk.fill()
                # A start the store refuses (f0 is taken) lets the controller give its WAL back to
                # the disk; the test takes that space too: 0 bytes free and an empty WAL.
                other = {
                    "model_sha256": sha,
                    "model_name": model.name,
                    "slot": SLOT,
                    "version": "3",
                    **GUARDS,
                }
                assert "still owns slot" in _refused(settings, "start", {**other, "devices": ["f0"]})
                disk.fill()
                fleet.set_online("f1", True)  # its job runs; the loop cannot store its states
                wait_until(
                    lambda: controller.count("fleet.rollout_store.disk_full") > 0,
                    timeout=30,
                    what="the loop met the full disk",
                )
                # The same episode: a request that needs the disk is refused, with no second warning.
                assert "the disk is full" in _refused(settings, "start", {**other, "devices": ["g0", "g1"]})
                with (
                    ControllerClient(settings, timeout=20) as client,
                    pytest.raises(RequestRefusedError) as up,
                ):
                    client.upload(big, sha256_file(big))
                assert "No space left on device" in up.value.reason
                assert "nothing of it was kept" in up.value.reason
                assert sorted(p.name for p in (state / "models").iterdir()) == [f"{sha}.onnx"]
                stuck = _status(settings, "full")
                during = controller.text()

                disk.free()  # no restart: the same process stores f1's end and finishes
                done = _ended(settings, "full")
                jobs = fleet.jobs()
                wal = state / "rollouts.sqlite-wal"
                wal_bytes = wal.stat().st_size if wal.exists() else 0
        finally:
            code = controller.stop()
    log = controller.text()
    assert code == 0, log[-3000:]
    assert stuck["devices"].get("ACTIVE") == 2, stuck  # f1's end waited for the disk
    assert done["state"] == "DONE", done
    assert done["devices"] == {"ACTIVE": 3}
    assert all(len(jobs[n]) == 1 for n in names), jobs
    # One warning for the whole episode, however often the loop retried, and one line when it ended.
    assert during.count("fleet.rollout_store.disk_full") == 1, during
    assert log.count("fleet.rollout_store.disk_full") == 1
    assert log.count("fleet.rollout_store.disk_writable") == 1
    ended = next(line for line in log.splitlines() if "fleet.rollout_store.disk_writable" in line)
    assert int(ended.split("failed_writes=")[1].split()[0]) >= 2, ended  # the loop's and the request's
    assert "Traceback" not in log
    assert "step_failed" not in log
    assert "request_failed" not in log
    assert wal_bytes <= WAL_LIMIT_BYTES * 1.1


class SentRowsFailOnce(RolloutStore):
    """The real store, whose first ``SENT`` row fails as a full disk fails it (a stand-in for a disk
    that fills between a wave's publish and its ``SENT`` rows: a moment a test cannot make a real disk
    choose, since the store gives its WAL back before each write)."""

    armed = True

    def mark_sent(self, rollout_id: str, device: str) -> str:
        if self.armed:
            self.armed = False
            raise StoreFullError(self.path, 0)
        return super().mark_sent(rollout_id, device)


def _clients() -> int:
    """MQTT service clients running in this process (one dispatch thread each)."""
    return sum(1 for thread in threading.enumerate() if thread.name == "mqtt-service-dispatch")


def test_a_wave_whose_sent_rows_cannot_be_stored_leaves_no_deploy_connected_and_opens_again(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles
) -> None:
    prefix = unique_prefix()
    settings = operator_settings(broker, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    body = {"model_sha256": sha256_file(model), "model_name": model.name, "slot": SLOT, "version": "2"}
    request = RolloutRequest.model_validate({**body, "devices": ["s0", "s1"], **GUARDS})
    store = SentRowsFailOnce(tmp_path / "rollouts.sqlite")
    store.create(request.plan("sent", "job-sent", 42, {}, {}))
    runner = RolloutRunner(
        store,
        "sent",
        settings=settings,
        model_path=lambda _sha: model,
        signing_key=load_signing_key(keys.private),
        key_id=keys.key_id,
        deploy_options={"serve": False, "wait_unknown": True, "status_poll_s": 1.0},
    )
    trusted = {keys.key_id: load_public_key(keys.public)}
    try:
        with ScriptedFleet(broker, prefix, ["s0", "s1"], slot=SLOT, trusted=trusted) as fleet:
            before = _clients()
            with pytest.raises(StoreFullError):
                runner.step()  # published, then the SENT rows failed: that deploy must be gone
            assert _clients() == before, "the failed wave's deploy is still connected"
            wait_until(lambda: runner.step() or store.rollout("sent").state.value == "DONE", timeout=30)
            jobs = fleet.jobs()
    finally:
        runner.stop()
        store.close()
    assert jobs == {"s0": ["job-sent"], "s1": ["job-sent"]}  # published twice, one job each
    reopened = RolloutStore(tmp_path / "rollouts.sqlite")
    assert [(d.step, d.sends) for d in reopened.devices("sent")] == [(DeviceStep.ENDED, 2)] * 2
    reopened.close()
