"""The controller's request API at its edges, against a real mosquitto: a verb it does not know, a
late device under ``on_timeout: wait``, what ``fleet rollout start`` sends.

The controller is the real one (a thread runs its loop, :class:`tests.fleet.controller.test_process.Running`);
the devices are :mod:`tests.fleet.scripted_fleet` stand-ins for a simulated fleet's devices.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient, RequestRefusedError
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fsutil import sha256_file
from agent.protocol.topics import CONTROLLER_VERBS, ControllerTopics, Topics
from tests.fleet.controller.test_process import (
    SLOT,
    Running,
    _fleet,
    _request,
    _start,
    _status,
    _wait_state,
    controller,
    keys,
    prefix,
)
from tests.fleet.operator_side import announce, operator_settings, tiny_model
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

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
    doc = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text()
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


def test_rollout_start_sends_the_calibration_flags_in_the_signed_manifest(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--calibration stream --calib-frames`` and ``--build-json`` reach the device, through the
    controller, as the manifest's ``build`` (docs/protocol.md, "Manifest artifacts")."""
    model = tiny_model(tmp_path / "m.onnx")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    desired = Topics(prefix, "c0").desired(SLOT)
    with _fleet(broker, prefix, keys, ["c0"]) as fleet, Probe(broker.host, broker.port) as device:
        device.subscribe(desired)
        argv = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--device", "c0"]
        argv += ["--precision", "int8", "--calibration", "stream", "--calib-frames", "300"]
        argv += ["--build-json", '{"workspace_mb": 2048}', "--no-shadow", "--probation-s", "0"]
        assert main([*argv, "--id", "calib", "--wait", *broker_args]) == 0, capsys.readouterr()
        manifest = json.loads(json.loads(device.wait_for_count(desired, 1)[0].payload)["manifest"])
        assert fleet.jobs()["c0"] != []
    assert manifest["build"] == {
        "precision": "int8",
        "workspace_mb": 2048,
        "calibration": {"kind": "stream", "frames": 300},
    }


def test_on_timeout_wait_keeps_waiting_for_a_device_that_starts_after_the_timeout(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    """Issue 19.2: 3 devices, one offline until the wave has timed out; shadow and probation on. Its
    job starts after the timeout (QUEUED, then ACTIVE a second later): the wave waits for it and the
    rollout ends DONE, each device with one job and one end, none skipped, none TIMED_OUT."""
    settings = operator_settings(broker, prefix)
    names = ["w0", "w1", "w2"]
    model = tiny_model(tmp_path / "m.onnx")
    store = controller.controller.store
    assert store is not None
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("w2", False)
        fleet.devices["w2"].delay_s = 1.0  # in its job for a while after its QUEUED: steps judge it
        body = _request(
            model,
            names,
            rollout_id="late",
            wave_timeout_s=2.0,
            on_timeout="wait",
            max_failed="0",
            shadow={"frames": 30, "min_agreement": 0.9},
            probation_s=5.0,
        )
        _start(settings, model, body)

        def timed_out() -> bool:
            return any(what == "timeout" for what, _ in store.events("late"))

        wait_until(timed_out, timeout=60, what="the wave timed out")
        logged = next(detail for what, detail in store.events("late") if what == "timeout")
        assert logged == {"wave": 0, "not_started": ["w2"]}
        assert _status(settings, "late")["state"] == "RUNNING"
        fleet.set_online("w2", True)  # started after the timeout
        ended = _wait_state(settings, "late", "DONE", "ABORTED")
        jobs = fleet.jobs()
        device_ends = [d for what, d in store.events("late") if what == "device" and "end" in d]
    assert ended["state"] == "DONE", ended["reason"]
    assert ended["devices"] == {"ACTIVE": 3}
    assert all(len(j) == 1 for j in jobs.values()), jobs
    assert sorted(d["device"] for d in device_ends) == names  # one end each
    assert {d["end"] for d in device_ends} == {"ACTIVE"}


def test_the_controller_refuses_to_start_a_rollout_of_an_uploaded_file_no_device_can_load(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    """The repository takes any bytes uploaded (an older CLI, a raw request): ``start`` checks the
    file before anything is stored or published (issue 20.15), answering ``bad_model``."""
    settings = operator_settings(broker, prefix)
    junk = tmp_path / "notes.onnx"
    junk.write_text("# not a model\n")
    store = controller.controller.store
    assert store is not None
    with Probe(broker.host, broker.port) as probe:
        announce(probe, prefix, "j0")
        probe.subscribe(f"{prefix}/+/down/#")
        with ControllerClient(settings, timeout=20) as client:
            client.upload(junk, sha256_file(junk))
            with pytest.raises(RequestRefusedError) as info:
                client.request("start", _request(junk, ["j0"], rollout_id="junk"))
        marker = f"{prefix}/j0/down/marker"
        probe.publish(marker, b"end")
        seen = probe.wait_for(lambda ms: any(m.topic == marker for m in ms))
    assert info.value.code == "bad_model"
    assert info.value.reason.startswith(f"model notes.onnx ({sha256_file(junk)[:12]}): model file is not")
    assert info.value.reason.endswith("; nothing signed or published")
    assert store.rollouts() == []
    assert [m.topic for m in seen] == [marker]


def test_every_rollout_command_with_json_prints_only_json_on_stdout(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 20.12: with ``--json`` stdout parses as JSON (``--wait``/``--watch``: one object a line),
    whatever the command says besides (selection, upload, ``-v`` logs) goes to stderr."""
    model = tiny_model(tmp_path / "m.onnx")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    # Not a fault test: what is checked is the CLI's output / the signed manifest, not a device's
    # checks (the fault tests run with shadow and probation on: tests/fleetsim/test_controller_faults.py).
    start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]

    def stdout_of(*argv: str) -> str:
        assert main([*argv, *broker_args]) == 0, capsys.readouterr().err
        shown = capsys.readouterr()
        return shown.out

    with _fleet(broker, prefix, keys, ["j0", "j1"]) as fleet:
        lines = stdout_of(*start, "--device", "j0", "--id", "one", "--json", "--wait", "-v").splitlines()
        assert [json.loads(line)["state"] for line in lines][-1] == "DONE"
        watched = stdout_of("fleet", "rollout", "status", "one", "--json", "--watch").splitlines()
        assert [json.loads(line)["state"] for line in watched] == ["DONE"]
        assert json.loads(stdout_of("fleet", "rollout", "status", "one", "--json"))["rollout_id"] == "one"
        assert [
            r["rollout_id"] for r in json.loads(stdout_of("fleet", "rollout", "list", "--json", "-v"))
        ] == ["one"]
        fleet.set_online("j1", False)  # its wave waits: pause, resume and abort act on a running rollout
        waiting = [*start, "--device", "j1", "--id", "two", "--on-timeout", "wait", "--json"]
        assert json.loads(stdout_of(*waiting))["rollout_id"] == "two"
        for verb, state in (("pause", "PAUSED"), ("resume", "RUNNING"), ("abort", "ABORTED")):
            assert json.loads(stdout_of("fleet", "rollout", verb, "two", "--json"))["state"] == state


def test_a_refused_action_is_answered_in_the_operators_words_and_an_unknown_rollout_is_not_found(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    """Issue 22.6: no "illegal rollout transition PAUSED -> PAUSED", and an unknown id is not_found
    on the broker API and 404 on the console (both through the real controller)."""
    from starlette.testclient import TestClient

    from agent.fleet.console.app import make_console_app
    from agent.fleet.controller.calls import ConsoleCalls
    from agent.fleet.view.live import FleetView

    settings = operator_settings(broker, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, ["p0", "p1"]):
        # A long soak keeps the rollout open whatever the devices do.
        started = _start(settings, model, _request(model, ["p0", "p1"], waves="1,100%", soak_s=3600))
        rollout_id = started["rollout_id"]
        with ControllerClient(settings, timeout=20) as client:
            assert client.request("pause", {"rollout_id": rollout_id})["state"] == "PAUSED"
            with pytest.raises(RequestRefusedError) as again:
                client.request("pause", {"rollout_id": rollout_id})
            with pytest.raises(RequestRefusedError) as unknown:
                client.request("resume", {"rollout_id": "no-such-rollout"})
        store = controller.controller.store
        assert store is not None
        token = uuid.uuid4().hex
        app = make_console_app(FleetView(prefix), store, ConsoleCalls(controller.controller), token=token)
        auth = {"authorization": f"Bearer {token}"}
        with TestClient(app) as web:
            console_unknown = web.post("/api/rollouts/no-such-rollout/pause", headers=auth)
            console_again = web.post(f"/api/rollouts/{rollout_id}/pause", headers=auth)
            assert web.post(f"/api/rollouts/{rollout_id}/abort", headers=auth).status_code == 200
            console_ended = web.post(f"/api/rollouts/{rollout_id}/resume", headers=auth)

    assert again.value.code == "wrong_state"
    assert (
        str(again.value) == f"controller refused pause: rollout {rollout_id} is already PAUSED: nothing to do"
    )
    assert unknown.value.code == "not_found"
    assert "no rollout no-such-rollout" in str(unknown.value)
    assert console_unknown.status_code == 404
    assert console_again.status_code == 409
    assert console_again.json()["error"] == f"rollout {rollout_id} is already PAUSED: nothing to do"
    assert console_ended.status_code == 409
    assert console_ended.json()["error"] == (
        f"rollout {rollout_id} has ended (ABORTED): it cannot be resumed any more"
    )
