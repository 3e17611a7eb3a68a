"""The controller rides through a broker restart (issue 19): real controller processes, a real
mosquitto killed with SIGKILL mid-wave and started again on the same port, with and without
persistence, and :mod:`agent.fleetsim` devices (the agent's own link, spool and delivery service;
simulated engines) running the rollout's jobs with shadow and probation.

While its lease connection is down the controller pauses (no request handled, no step), then
reads the claim and takes the lease back (controller/lease.py); the rollout ends DONE with one run of
the job per device. A standby on the same prefix stays standing by: one controller drives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.controller.calls import LoopCall
from agent.fleet.controller.client import ControllerClient, ControllerUnavailableError
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.lease import read_lease
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.mqtt.settings import MqttSettings
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.controller.test_lease import Child, _config_file, _spawn
from tests.fleet.controller.test_process import _request, _start, _status
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.fleetsim.sim_fleet import SimFleet
from tests.tcp_proxy import FreezableProxy
from tests.waiting import patient, wait_until

#: Shadow and probation as operators run them (the rollout's defaults ask for neither).
_GUARDS: dict[str, Any] = {"shadow": {"frames": 10}, "probation_s": 3.0}
#: Where the store shows a device whose desired state is sent and whose job has not ended.
#: Every test here restarts a broker or kills a controller (15-36 s each): started first under xdist.
pytestmark = pytest.mark.slow

_IN_FLIGHT = (
    "PENDING",
    "QUEUED",
    "DOWNLOADING",
    "VERIFYING",
    "BUILDING",
    "VALIDATING",
    "SHADOW",
    "PROBATION",
)


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


@pytest.fixture
def stopped() -> Iterator[list[Broker | SimFleet]]:
    """Brokers and simulated fleets a test appends here are stopped at its end (fleets first)."""
    started: list[Broker | SimFleet] = []
    yield started
    for part in reversed(started):
        if isinstance(part, SimFleet):
            part.stop()
        else:
            part.kill()


def _broker(tmp_path: Path, stopped: list[Broker | SimFleet], *, persistence: bool) -> Broker:
    extra: list[str] = []
    if persistence:
        (tmp_path / "persist").mkdir()
        extra = ["persistence true", f"persistence_location {tmp_path / 'persist'}/", "autosave_interval 1"]
    broker = Broker(tmp_path / "broker", extra)
    broker.start()
    stopped.append(broker)
    return broker


def _sim_fleet(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, prefix: str, stopped: list[Broker | SimFleet]
) -> SimFleet:
    v1 = write_classifier(tmp_path / "cls-1.onnx", input_size=32, num_classes=4, seed=1)
    fleet = SimFleet(tmp_path, broker, keys, prefix, devices=4, procs=1, model=v1)
    stopped.append(fleet)
    fleet.wait_online()
    return fleet


def _kill_mid_wave(settings: MqttSettings, broker: Broker, rollout_id: str) -> None:
    """SIGKILL the broker once the canary's desired state is out and its job not ended (the first
    wave open: the job takes seconds, its probation alone 3 s), and start it again."""

    def canary_working() -> bool:
        status = _status(settings, rollout_id)
        assert status["waves"][0]["state"] != "DONE", f"the canary's wave ended before the kill: {status}"
        if any(state in _IN_FLIGHT for state in status["devices"]):
            return True
        time.sleep(0.2)
        return False

    wait_until(canary_working, timeout=60, what="the canary's job under way")
    broker.restart(hard=True)


def _wait_done(settings: MqttSettings, rollout_id: str) -> dict[str, Any]:
    """The rollout's status once it ended. A request sent before the controller's request connection
    is back on the restarted broker reaches nobody and is not answered: asked again, as an operator
    would."""
    seen: dict[str, Any] = {}

    def ended() -> bool:
        try:
            with ControllerClient(settings, timeout=5) as client:
                seen.update(client.request("status", {"rollout_id": rollout_id}))
        except ControllerUnavailableError:
            return False
        if seen["state"] in ("DONE", "ABORTED"):
            return True
        time.sleep(0.3)
        return False

    wait_until(ended, timeout=120, what=f"rollout {rollout_id} ended")
    return seen


def _answers_list(settings: MqttSettings) -> bool:
    try:
        with ControllerClient(settings, timeout=5) as client:
            return bool(client.request("list", {})["rollouts"] == [])
    except ControllerUnavailableError:
        return False  # asked before the controller's request connection was back: ask again


def _runs(fleet: SimFleet) -> dict[str, Any]:
    """How often each device ran each job id (the simulator's own count)."""
    devices: dict[str, Any] = fleet.wait_report_after(time.time(), timeout=30)["devices"]
    return {device: devices[device]["runs"] for device in fleet.ids}


@pytest.mark.parametrize("persistence", [False, True], ids=["no-persistence", "persistence"])
def test_the_controller_rides_through_a_broker_killed_mid_wave_and_the_rollout_ends_done(
    tmp_path: Path,
    keys: KeyPairFiles,
    prefix: str,
    children: list[Child],
    stopped: list[Broker | SimFleet],
    persistence: bool,
) -> None:
    broker = _broker(tmp_path, stopped, persistence=persistence)
    settings = operator_settings(broker, prefix)
    fleet = _sim_fleet(tmp_path, broker, keys, prefix, stopped)
    controller = _spawn(
        children,
        _config_file(tmp_path / "c.yaml", broker, prefix, keys, tmp_path / "state"),
        tmp_path / "c.log",
    )
    controller.wait_serving_or_exit()
    assert controller.serving(), controller.text()
    v2 = write_classifier(tmp_path / "cls-2.onnx", input_size=32, num_classes=4, seed=2)
    body = _request(v2, fleet.ids, slot="main", rollout_id="ride", waves="1,100%", **_GUARDS)
    _start(settings, v2, body)

    _kill_mid_wave(settings, broker, "ride")

    wait_until(
        lambda: "fleet.controller.lease.regained" in controller.text() or controller.proc.poll() is not None,
        timeout=60,
        what="the controller to take its lease back",
    )
    assert controller.proc.poll() is None, controller.text()
    assert "fleet.controller.lease.paused" in controller.text()
    done = _wait_done(settings, "ride")
    assert done["state"] == "DONE", done
    assert done["devices"] == {"ACTIVE": 4}
    assert _runs(fleet) == {key: {done["job_id"]: 1} for key in fleet.ids}
    claim = read_lease(settings)
    assert claim is not None
    assert claim.pid == controller.proc.pid
    assert controller.proc.poll() is None


def test_with_a_standby_the_holder_takes_its_lease_back_and_drives_alone_after_a_broker_restart(
    tmp_path: Path, keys: KeyPairFiles, prefix: str, children: list[Child], stopped: list[Broker | SimFleet]
) -> None:
    """The standby shares the holder's state directory (as a second unit on its storage would); its
    claim's ttl (60 s) is far longer than the restart, so it is the holder that takes the lease back."""
    broker = _broker(tmp_path, stopped, persistence=False)
    settings = operator_settings(broker, prefix)
    fleet = _sim_fleet(tmp_path, broker, keys, prefix, stopped)
    state = tmp_path / "state"
    holder = _spawn(
        children, _config_file(tmp_path / "h.yaml", broker, prefix, keys, state), tmp_path / "h.log"
    )
    holder.wait_serving_or_exit()
    assert holder.serving(), holder.text()
    standby = _spawn(
        children,
        _config_file(tmp_path / "s.yaml", broker, prefix, keys, state, standby=True),
        tmp_path / "s.log",
    )
    wait_until(lambda: "standing by" in standby.text(), timeout=30, what="the standby's line")
    v2 = write_classifier(tmp_path / "cls-2.onnx", input_size=32, num_classes=4, seed=2)
    _start(settings, v2, _request(v2, fleet.ids, slot="main", rollout_id="pair", waves="1,100%", **_GUARDS))

    _kill_mid_wave(settings, broker, "pair")

    done = _wait_done(settings, "pair")
    assert done["state"] == "DONE", done
    assert _runs(fleet) == {key: {done["job_id"]: 1} for key in fleet.ids}
    claim = read_lease(settings)
    assert claim is not None
    assert claim.pid == holder.proc.pid
    assert holder.serving(), holder.text()
    assert "fleet.controller.lease.regained" in holder.text()
    # The standby outlived the broker's restart and still stands by: it never drove.
    assert standby.proc.poll() is None, standby.text()
    assert "requests on" not in standby.text()


def test_a_request_waits_while_the_lease_is_down_and_is_handled_once_it_is_back(
    tmp_path: Path, keys: KeyPairFiles, prefix: str, stopped: list[Broker | SimFleet]
) -> None:
    """The console's call reaches the loop while the broker is down: it is run only once the
    controller holds its lease again (and sees the lease held when it runs)."""
    broker = _broker(tmp_path, stopped, persistence=False)
    settings = operator_settings(broker, prefix)
    config = ControllerConfig(
        mqtt=settings, state_dir=tmp_path / "state", signing_key=keys.private, key_id=keys.key_id
    )
    loop = RunningController(config, catch=BaseException)
    controller, failed = loop.controller, loop.raised
    try:
        broker.kill()
        wait_until(lambda: controller.lease.lost is not None, what="the controller to see its lease down")
        seen: list[str | None] = []

        def note() -> dict[str, Any]:
            seen.append(controller.lease.lost)
            return {}

        call = LoopCall(note)
        controller._requests.put(call)
        wait_until(lambda: controller._requests.qsize() == 0, what="the loop to take the call")
        assert seen == []  # paused: taken, not run, while the lease is down
        broker.restart()
        call.result(patient(60))
        assert seen == [None]  # run with the lease held again
        assert loop.thread.is_alive(), failed
        wait_until(lambda: _answers_list(settings), timeout=60, what="the controller answering again")
    finally:
        loop.stop()


def test_a_controller_whose_link_froze_pauses_and_takes_its_lease_back(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles, prefix: str
) -> None:
    """The link drops, the broker stays up: every connection of the controller goes through a proxy
    that stalls them all (a pulled cable). Each side sees it after its keep-alive; the controller
    pauses, connects again (new connections pass) and takes its lease back under the same claim."""
    proxy = FreezableProxy(broker.host, broker.port).start()
    settings = MqttSettings(
        host="127.0.0.1",
        port=proxy.port,
        prefix=prefix,
        keepalive_s=5,
        reconnect_min_s=0.05,
        reconnect_max_s=0.3,
    )
    config = ControllerConfig(
        mqtt=settings, state_dir=tmp_path / "state", signing_key=keys.private, key_id=keys.key_id
    )
    loop = RunningController(config, catch=BaseException)
    controller, failed = loop.controller, loop.raised
    try:
        proxy.freeze()
        wait_until(
            lambda: controller.lease.lost is not None or bool(failed), timeout=60, what="the lease to drop"
        )
        assert controller.lease.lost_for_good is None
        wait_until(lambda: controller.lease.lost is None or bool(failed), timeout=60, what="the lease back")
        assert not failed, failed
        assert loop.thread.is_alive()
        # The retained claim, read until it is this controller's: the frozen connection's Last Will
        # (an empty claim) may reach the broker after the new connection's claim; the holder's next
        # renewal (every ttl_s / 3) puts it back, and the client id keeps any other controller out
        # meanwhile.
        holder = controller.lease.claim.holder

        def held_again() -> bool:
            claim = read_lease(operator_settings(broker, prefix))
            return claim is not None and claim.holder == holder

        wait_until(held_again, timeout=60, what="the retained claim to be this controller's again")
        wait_until(lambda: _answers_list(settings), timeout=60, what="the controller answering again")
    finally:
        loop.stop()
        proxy.close()


def test_a_standby_whose_wait_ends_while_the_broker_is_down_stands_by_through_it_and_one_holds_after(
    tmp_path: Path, keys: KeyPairFiles, prefix: str, children: list[Child], stopped: list[Broker | SimFleet]
) -> None:
    """A 3 s claim: the standby's wait runs out while the broker is down and its read fails; it
    tries again instead of exiting. Once the broker is back (no persistence: no claim), the holder
    and the standby may both find the lease free; the broker keeps one connection of the lease's
    client id, and in the end one controller holds the lease and the other does not drive (it
    stands by, or it was the holder and stopped, as one whose lease is taken does)."""
    broker = _broker(tmp_path, stopped, persistence=False)
    settings = operator_settings(broker, prefix)
    holder = _spawn(
        children,
        _config_file(tmp_path / "h.yaml", broker, prefix, keys, tmp_path / "state-h", lease_ttl_s=3),
        tmp_path / "h.log",
    )
    holder.wait_serving_or_exit()
    assert holder.serving(), holder.text()
    standby = _spawn(
        children,
        _config_file(tmp_path / "s.yaml", broker, prefix, keys, tmp_path / "state-s", standby=True),
        tmp_path / "s.log",
    )
    pair = [holder, standby]
    wait_until(lambda: "standing by" in standby.text(), timeout=30, what="the standby's line")

    broker.kill()
    wait_until(
        lambda: (
            "fleet.controller.standby.broker_unreachable" in standby.text() or standby.proc.poll() is not None
        ),
        timeout=60,
        what="the standby's wait to end while the broker is down",
    )
    assert standby.proc.poll() is None, standby.text()
    broker.start()

    def one_holder() -> bool:
        claim = read_lease(settings)
        owners = [c for c in pair if claim is not None and c.proc.pid == claim.pid and c.proc.poll() is None]
        others = [c for c in pair if c not in owners]
        if len(owners) != 1:
            return False
        # The other stopped, or it is the standby and never served (the holder, alive, may still act).
        return all(
            c.proc.poll() is not None or (c is standby and "requests on" not in c.text()) for c in others
        )

    wait_until(one_holder, timeout=90, what="one controller holding the lease")
    claim = read_lease(settings)
    assert claim is not None
    (owner,) = [c for c in pair if c.proc.pid == claim.pid]
    (other,) = [c for c in pair if c is not owner]
    assert owner.proc.poll() is None
    wait_until(lambda: "requests on" in owner.text(), timeout=30, what="the holder serving")
    if other.proc.poll() is not None:  # the holder that lost the race: stopped, naming why
        assert other is holder
        assert other.proc.returncode == 1, other.text()
        assert "another controller may hold prefix" in other.text() or "was taken by" in other.text()
    else:  # the standby that lost the race, or never raced: standing by, never serving
        assert other is standby
        assert "requests on" not in standby.text()
