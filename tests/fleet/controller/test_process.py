"""The fleet controller against a real mosquitto: rollouts in waves, the gate, pause/resume/abort,
rollback on abort, overlap, model upload, all through its broker API (the CLI's client).

The devices are :mod:`tests.fleet.scripted_fleet` (plain paho stand-ins for a simulated fleet's
devices: they check signatures and keep one job per job id as the agent does); the controller is the
real one, in this process (a thread runs its loop). The kill -9 test runs it as a child process.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient, RequestRefusedError
from agent.fleet.controller.config import ControllerConfig, load_controller_config
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fsutil import sha256_file
from agent.mqtt.settings import MqttSettings
from agent.signing import load_public_key
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.fleet.scripted_fleet import ScriptedFleet
from tests.waiting import patient, wait_until

SLOT = "cls"


#: The controller fixture's type (other rooms' tests import it from here).
Running = RunningController


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


def _config(tmp_path: Path, settings: MqttSettings, keys: KeyPairFiles) -> ControllerConfig:
    return ControllerConfig(
        mqtt=settings,
        state_dir=tmp_path / "controller",
        signing_key=keys.private,
        key_id=keys.key_id,
        status_poll_s=1.0,
        select_wait_s=0.5,
    )


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles) -> Iterator[Running]:
    running = Running(_config(tmp_path, operator_settings(broker, prefix), keys))
    yield running
    running.stop()


def _request(model: Path, devices: list[str], **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_sha256": sha256_file(model),
        "model_name": model.name,
        "slot": SLOT,
        "version": "2",
        "devices": devices,
        "chunk_size": 4096,
    }
    body.update(fields)
    return body


def _start(settings: MqttSettings, model: Path, body: dict[str, Any]) -> dict[str, Any]:
    with ControllerClient(settings, timeout=20) as client:
        return client.start(body, model)


def _status(settings: MqttSettings, rollout_id: str) -> dict[str, Any]:
    with ControllerClient(settings, timeout=20) as client:
        return client.request("status", {"rollout_id": rollout_id})


def _wait_state(settings: MqttSettings, rollout_id: str, *states: str, timeout: float = 60) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(_status(settings, rollout_id))
        if seen["state"] in states:
            return True
        time.sleep(0.3)
        return False

    wait_until(reached, timeout=timeout, what=f"rollout {rollout_id} in {states}")
    return seen


def _fleet(broker: Broker, prefix: str, keys: KeyPairFiles, names: list[str]) -> ScriptedFleet:
    return ScriptedFleet(
        broker, prefix, names, slot=SLOT, trusted={keys.key_id: load_public_key(keys.public)}
    )


def test_a_rollout_runs_wave_by_wave_and_each_device_gets_one_job(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    settings = operator_settings(broker, prefix)
    names = [f"d{i}" for i in range(6)]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        started = _start(settings, model, _request(model, names, waves="1,50%,100%", rollout_id="r1"))
        assert [w["devices"] for w in started["waves"]] == [1, 2, 3]
        done = _wait_state(settings, "r1", "DONE", "ABORTED")
        jobs = fleet.jobs()
        timeline = {n: (d.started, d.ended) for n, d in fleet.devices.items()}
    assert done["state"] == "DONE", done
    assert [w["state"] for w in done["waves"]] == ["DONE", "DONE", "DONE"]
    assert done["devices"] == {"ACTIVE": 6}
    assert all(len(j) == 1 for j in jobs.values()), jobs
    assert len({j[0] for j in jobs.values()}) == 1  # one job id for the whole rollout
    # Each wave started only once the previous one's devices had all ended.
    waves = [["d0"], ["d1", "d2"], ["d3", "d4", "d5"]]
    for before, after in itertools.pairwise(waves):
        last_end = max(next(iter(timeline[n][1].values())) for n in before)
        first_start = min(next(iter(timeline[n][0].values())) for n in after)
        assert first_start > last_end
    # The model went through the upload into the controller's repository, named by its hash.
    assert (
        tmp_path / "controller" / "models" / f"{sha256_file(model)}.onnx"
    ).read_bytes() == model.read_bytes()


def test_a_canary_that_fails_the_gate_aborts_and_rolls_the_canaries_back(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    settings = operator_settings(broker, prefix)
    names = [f"d{i}" for i in range(8)]
    v1 = tiny_model(tmp_path / "v1" / "m.onnx")
    v2 = tmp_path / "v2.onnx"
    v2.write_bytes(tiny_model(tmp_path / "v2src" / "m.onnx").read_bytes() + b"")  # same graph, own file
    from agent.demo.modelzoo import write_classifier

    write_classifier(v2, input_size=32, num_classes=4, seed=9)
    with _fleet(broker, prefix, keys, names) as fleet:
        _start(settings, v1, _request(v1, names, version="1", rollout_id="base", waves="100%"))
        assert _wait_state(settings, "base", "DONE", "ABORTED")["state"] == "DONE"
        assert set(fleet.models().values()) == {"1"}
        fleet.devices["d1"].agreement = 0.4  # the canary's shadow disagrees: ACTIVE but unhealthy
        body = _request(
            v2,
            names,
            version="2",
            rollout_id="bad",
            waves="2,100%",
            max_failed="0",
            shadow={"frames": 30, "min_agreement": 0.9},
            rollback_on_abort=True,
        )
        _start(settings, v2, body)
        ended = _wait_state(settings, "bad", "ABORTED", "DONE")
        assert ended["state"] == "ABORTED"
        assert "gate trips" in ended["reason"]
        assert "1 unhealthy" in ended["reason"]
        assert [w["state"] for w in ended["waves"]] == ["TRIPPED", "CANCELLED"]
        wait_until(
            lambda: fleet.models() == dict.fromkeys(names, "1"), timeout=30, what="canaries back on v1"
        )
        wait_until(
            lambda: (_status(settings, "bad").get("rollback") or {}).get("ends") is not None,
            timeout=30,
            what="rollback followed to its end",
        )
        jobs = fleet.jobs()
        final = _status(settings, "bad")
    assert final["rollback"]["by_desired_state"] == 2
    assert final["rollback"]["ends"] == {"ACTIVE": 2}
    # Beyond the canary nothing was touched: one job (the base rollout's) on each later device.
    assert all(len(jobs[n]) == 1 for n in names[2:]), jobs
    assert all(len(jobs[n]) == 3 for n in names[:2]), jobs  # base, the bad one, the rollback


def test_a_finished_rollout_is_rolled_back_in_waves_one_rollout_per_previous_model(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    """``rollback`` of a DONE rollout: its devices back to the model each ran before it, in waves
    with the gate; devices that ran two models before get a rollout each; a second one is refused."""
    from agent.demo.modelzoo import write_classifier

    settings = operator_settings(broker, prefix)
    names = [f"f{i}" for i in range(4)]
    v1 = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    v1b = write_classifier(tmp_path / "v1b.onnx", input_size=32, num_classes=4, seed=2)
    v2 = write_classifier(tmp_path / "v2.onnx", input_size=32, num_classes=4, seed=3)
    with _fleet(broker, prefix, keys, names) as fleet:
        _start(settings, v1, _request(v1, names[:2], version="1", rollout_id="base-a"))
        _start(settings, v1b, _request(v1b, names[2:], version="1b", rollout_id="base-b"))
        for rollout in ("base-a", "base-b"):
            assert _wait_state(settings, rollout, "DONE", "ABORTED")["state"] == "DONE"
        shadow = {"frames": 30, "min_agreement": 0.9}
        _start(
            settings, v2, _request(v2, names, version="2", rollout_id="new", waves="1,100%", shadow=shadow)
        )
        assert _wait_state(settings, "new", "DONE", "ABORTED")["state"] == "DONE"
        assert set(fleet.models().values()) == {"2"}
        with ControllerClient(settings, timeout=20) as client:
            with pytest.raises(RequestRefusedError, match="rollout base-a has no device to move back"):
                client.request("rollback", {"rollout_id": "base-a"})  # no rollout deployed their model before
            answer = client.request("rollback", {"rollout_id": "new", "waves": "1,100%"})
        ids = [status["rollout_id"] for status in answer["rollbacks"]]
        assert ids == [f"new-rollback-{sha256_file(v1)[:8]}", f"new-rollback-{sha256_file(v1b)[:8]}"]
        ended = [_wait_state(settings, rollout, "DONE", "ABORTED") for rollout in ids]
        models = fleet.models()
        jobs = fleet.jobs()
        with (
            ControllerClient(settings, timeout=20) as client,
            pytest.raises(RequestRefusedError, match="was rolled back already, by new-rollback-"),
        ):
            client.request("rollback", {"rollout_id": "new"})
        finished = _status(settings, "new")
    assert [e["state"] for e in ended] == ["DONE", "DONE"]
    assert [[w["devices"] for w in e["waves"]] for e in ended] == [[1, 1], [1, 1]]  # in waves
    assert [e["devices"] for e in ended] == [{"ACTIVE": 2}, {"ACTIVE": 2}]
    assert [e["rollback_of"] for e in ended] == ["new", "new"]
    assert finished["rolled_back_by"] == ids
    assert models == {"f0": "1", "f1": "1", "f2": "1b", "f3": "1b"}
    assert all(len(jobs[n]) == 3 for n in names), jobs  # its base, the new one, the way back: once each


def test_pause_holds_the_next_wave_resume_goes_on_and_an_overlap_is_refused(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    settings = operator_settings(broker, prefix)
    names = ["p0", "p1", "p2"]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("p0", False)  # the canary is offline: its wave waits (on_timeout wait)
        _start(settings, model, _request(model, names, rollout_id="slow", waves="1,100%", on_timeout="wait"))
        with ControllerClient(settings) as client:
            paused = client.request("pause", {"rollout_id": "slow"})
            assert paused["state"] == "PAUSED"
            with pytest.raises(RequestRefusedError, match="still owns slot 'cls' on 1 of these devices: p1"):
                client.request("start", _request(model, ["p1"], rollout_id="other"))
            with pytest.raises(RequestRefusedError, match="no rollout nope"):
                client.request("pause", {"rollout_id": "nope"})
        fleet.set_online("p0", True)
        wait_until(
            lambda: _status(settings, "slow")["waves"][0]["state"] == "DONE", timeout=30, what="wave 1 ends"
        )
        time.sleep(1.0)
        held = _status(settings, "slow")
        assert held["state"] == "PAUSED"
        assert held["waves"][1]["state"] == "WAITING"
        assert fleet.jobs()["p1"] == []  # paused: the next wave was not started
        with ControllerClient(settings) as client:
            client.request("resume", {"rollout_id": "slow"})
        assert _wait_state(settings, "slow", "DONE", "ABORTED")["state"] == "DONE"
        assert all(len(j) == 1 for j in fleet.jobs().values())


def test_an_operator_abort_touches_no_new_device(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    settings = operator_settings(broker, prefix)
    names = ["a0", "a1", "a2"]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("a0", False)
        _start(settings, model, _request(model, names, rollout_id="stop", waves="1,100%", on_timeout="wait"))
        with ControllerClient(settings) as client:
            aborted = client.request("abort", {"rollout_id": "stop"})
        assert aborted["state"] == "ABORTED"
        assert aborted["reason"] == "aborted by the operator"
        assert [w["state"] for w in aborted["waves"]] == ["CANCELLED", "CANCELLED"]
        fleet.set_online("a0", True)  # it still gets the desired state sent before the abort
        time.sleep(1.5)
        jobs = fleet.jobs()
    assert len(jobs["a0"]) == 1
    assert jobs["a1"] == []
    assert jobs["a2"] == []


@pytest.mark.slow
def test_the_controller_killed_mid_wave_resumes_with_no_device_twice_and_none_skipped(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    settings = operator_settings(broker, prefix)
    names = [f"k{i}" for i in range(5)]
    model = tiny_model(tmp_path / "m.onnx")
    config = tmp_path / "controller.yaml"
    config.write_text(
        f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {prefix}}}\n"
        f"state_dir: {tmp_path / 'state'}\nsigning_key: {keys.private}\nkey_id: {keys.key_id}\n"
        "status_poll_s: 1\nselect_wait_s: 0.5\n"
    )
    assert load_controller_config(config).key_id == keys.key_id

    log = tmp_path / "controller.log"

    def spawn() -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
        mark = log.stat().st_size if log.exists() else 0
        with log.open("ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: b"requests on" in log.read_bytes()[mark:] or child.poll() is not None,
            timeout=30,
            what="the controller's ready line",
        )
        assert child.poll() is None, log.read_text()
        return child

    child = spawn()
    try:
        with _fleet(broker, prefix, keys, names) as fleet:
            fleet.set_online("k1", False)  # wave 1 (k0, k1) stays open: k1 is offline
            _start(
                settings, model, _request(model, names, rollout_id="kill", waves="2,100%", on_timeout="wait")
            )
            wait_until(lambda: len(fleet.jobs()["k0"]) == 1, timeout=30, what="k0 ran its job")
            child.send_signal(signal.SIGKILL)
            child.wait(patient(10))
            fleet.set_online("k1", True)  # it gets the retained desired state while no controller runs
            wait_until(lambda: len(fleet.jobs()["k1"]) == 1, timeout=30, what="k1 ran its job")
            child = spawn()
            done = _wait_state(settings, "kill", "DONE", "ABORTED", timeout=90)
            jobs = fleet.jobs()
    finally:
        child.kill()
        child.wait(patient(10))
    assert done["state"] == "DONE"
    assert done["devices"] == {"ACTIVE": 5}
    assert all(len(j) == 1 for j in jobs.values()), jobs
    assert {j[0] for j in jobs.values()} == {done["job_id"]}


def test_the_rollout_commands_select_show_start_follow_and_list(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    controller: Running,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.cli import main

    names = ["c0", "c1", "c2", "c3"]
    model = tiny_model(tmp_path / "m.onnx")
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with _fleet(broker, prefix, keys, names) as fleet:
        for n in ("c0", "c1", "c2"):
            fleet.devices[n].labels = {"site": "berlin-3"}
            fleet.set_online(n, True)  # announces the labels
        # Not a fault test: what is checked is the CLI's selection, output and listing (the fault tests
        # run with shadow and probation on: tests/fleetsim/test_controller_faults.py).
        start = ["fleet", "rollout", "start", str(model), "--slot", SLOT, "--version", "2", "--no-shadow"]
        start += ["--select", "site=berlin-3", "--retained-wait", "1", "--waves", "1,100%", "--id", "cli"]
        assert main([*start, "--dry-run", *broker_args]) == 0
        shown = capsys.readouterr().out
        assert "selected 3 device(s): c0, c1, c2" in shown
        assert "--dry-run: nothing sent" in shown
        assert fleet.jobs() == {key: [] for key in names}
        assert main([*start, "--wait", *broker_args]) == 0  # exit 0: the rollout ended DONE
        out = capsys.readouterr().out
        assert "uploading m.onnx" in out
        assert "rollout cli: DONE" in out
        assert "wave 2: DONE" in out
        assert main(["fleet", "rollout", "status", "cli", "--json", *broker_args]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["devices"] == {"ACTIVE": 3}
        assert main(["fleet", "rollout", "list", *broker_args]) == 0
        assert capsys.readouterr().out.startswith("cli ")
        assert main(["fleet", "rollout", "pause", "cli", *broker_args]) != 0  # a DONE rollout stays DONE
        assert "rollout cli" in capsys.readouterr().err
        # With --json, stdout is the controller's answer alone (the selection lines go to stderr).
        again = [arg if arg != "cli" else "cli-json" for arg in start]
        assert main([*again, "--json", *broker_args]) == 0
        answer = capsys.readouterr()
        assert json.loads(answer.out)["rollout_id"] == "cli-json"
        assert "selected 3 device(s)" in answer.err
        assert (
            _wait_state(operator_settings(broker, prefix), "cli-json", "DONE", "ABORTED")["state"] == "DONE"
        )
        jobs = fleet.jobs()
    assert jobs["c3"] == []  # not selected
    assert all(len(jobs[n]) == 2 for n in ("c0", "c1", "c2"))  # one job per rollout


def test_the_controller_serves_the_console_and_metrics_and_its_pause_button_acts_on_the_loop(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    import urllib.error
    import urllib.request

    from agent.demo.broker import free_port
    from agent.fleet.controller.config import HttpSettings

    token = tmp_path / "console.token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    config = _config(tmp_path, operator_settings(broker, prefix), keys).model_copy(
        update={"http": HttpSettings(port=free_port(), token_file=token)}
    )
    names = ["w0", "w1"]
    model = tiny_model(tmp_path / "m.onnx")
    running = Running(config)
    try:
        url = running.controller.http.url
        with _fleet(broker, prefix, keys, names) as fleet:
            fleet.set_online("w1", False)  # offline: its wave, and the rollout, stay open
            _start(
                settings := operator_settings(broker, prefix), model, _request(model, names, rollout_id="web")
            )

            def get(path: str) -> str:
                with urllib.request.urlopen(url + path, timeout=patient(10)) as response:
                    return str(response.read().decode())

            wait_until(
                lambda: 'edge_device_online{device="w0"} 1.0' in get("/metrics"), what="w0 in /metrics"
            )
            assert 'edge_device_online{device="w1"} 0.0' in get("/metrics")
            assert '"web"' in get("/api/rollouts")
            refused = urllib.request.Request(url + "/api/rollouts/web/pause", method="POST")
            with pytest.raises(urllib.error.HTTPError) as no_token:
                urllib.request.urlopen(refused, timeout=patient(10))
            assert no_token.value.code == 401
            allowed = urllib.request.Request(
                url + "/api/rollouts/web/pause", method="POST", headers={"Authorization": "Bearer s3cret"}
            )
            with urllib.request.urlopen(allowed, timeout=patient(10)) as response:
                assert "PAUSED" in response.read().decode()
            assert _status(settings, "web")["state"] == "PAUSED"
    finally:
        running.stop()


def test_a_wave_whose_publish_failed_is_published_at_the_next_step(
    tmp_path: Path, keys: KeyPairFiles
) -> None:
    """The broker is down when the wave starts: the step fails, the devices stay SENDING, and once
    the broker is up the next step publishes the same desired state (not skipped, not twice)."""
    from agent.demo.broker import free_port
    from agent.errors import TransportError
    from agent.fleet.deploy.keys import load_signing_key
    from agent.fleet.rollout.records import DeviceStep
    from agent.fleet.rollout.runner import RolloutRunner
    from agent.fleet.rollout.spec import RolloutRequest
    from agent.fleet.rollout.store import RolloutStore

    port = free_port()
    local = Broker(tmp_path / "broker", port=port)
    prefix = unique_prefix()
    settings = operator_settings(local, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    request = RolloutRequest.model_validate(_request(model, ["b0", "b1"], shadow=None))
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    store.create(request.plan("down", "job-down", 42, {}, {}))
    runner = RolloutRunner(
        store,
        "down",
        settings=settings,
        model_path=lambda _sha: model,
        signing_key=load_signing_key(keys.private),
        key_id=keys.key_id,
        deploy_options={"serve": True, "wait_unknown": True, "status_poll_s": 1.0},
    )
    try:
        with pytest.raises(TransportError):
            runner.step()
        assert {d.step for d in store.devices("down")} == {DeviceStep.SENDING}
        local.start()
        with _fleet(local, prefix, keys, ["b0", "b1"]) as fleet:
            wait_until(lambda: runner.step() or store.rollout("down").state.value == "DONE", timeout=30)
            jobs = fleet.jobs()
        assert jobs == {"b0": ["job-down"], "b1": ["job-down"]}
        assert {d.sends for d in store.devices("down")} == {2}  # SENDING twice: the failed try, the retry
    finally:
        runner.stop()
        store.close()
        local.kill()


def test_a_canary_still_in_flight_at_the_trip_is_rolled_back_by_command_when_its_old_model_is_unknown(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, controller: Running
) -> None:
    """The devices run a model this controller never deployed: no desired state can name it, so the
    canary that goes ACTIVE after the gate tripped gets the device's own rollback command, once."""
    from agent.protocol.messages import JobState

    settings = operator_settings(broker, prefix)
    names = ["u0", "u1", "u2", "u3"]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.devices["u0"].end = JobState.FAILED
        fleet.devices["u1"].delay_s = 2.0  # still working when u0's failure trips the gate
        body = _request(model, names, rollout_id="blind", waves="2,100%", rollback_on_abort=True)
        _start(settings, model, body)
        assert _wait_state(settings, "blind", "ABORTED", "DONE")["state"] == "ABORTED"
        wait_until(
            lambda: (_status(settings, "blind").get("rollback") or {}).get("ends") is not None,
            timeout=30,
            what="the rollback ended",
        )
        final = _status(settings, "blind")
        models = fleet.models()
        rollbacks = {n: d.rollbacks for n, d in fleet.devices.items()}
        jobs = fleet.jobs()
    assert final["rollback"] == {
        "by_desired_state": 0,
        "by_command": 1,
        "no_previous": [],
        "ends": {"ROLLED_BACK": 1},
    }
    assert models == dict.fromkeys(names, "1")  # u1 went ACTIVE on v2, then back; u0 failed; u2, u3 untouched
    assert rollbacks == {"u0": 0, "u1": 1, "u2": 0, "u3": 0}
    assert jobs["u2"] == []
    assert jobs["u3"] == []
