"""One controller per prefix (issue 19, point 4): real controller processes on a real mosquitto.

Before the lease, two controllers on one prefix each made a rollout of every ``rollout start``, and
every device got two job ids for the same model. Here the second one refuses, naming the holder;
two started at once leave one; a standby takes over from a holder killed with SIGKILL and finishes
its rollout from the same state directory; a holder whose lease connection is taken stops and
does not take it back. The devices are :mod:`tests.fleet.scripted_fleet` stand-ins (shadow and
probation as the rollout's defaults ask).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.lease import LeaseLostError, PrefixLease, describe, lease_client_id, read_lease
from agent.fleet.controller.process import FleetController
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.protocol.messages import ControllerLease, decode
from agent.protocol.topics import ControllerTopics
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.controller.test_process import _fleet, _request, _start, _wait_state
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops")


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


class Child:
    """``edge-agent fleet controller --config FILE`` as a child process, its output in a file."""

    def __init__(self, config: Path, log: Path) -> None:
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving_or_exit(self, timeout: float = 30) -> None:
        wait_until(
            lambda: "requests on" in self.text() or self.proc.poll() is not None,
            timeout=timeout,
            what=f"{self.log.name}: the controller's ready line or its exit",
        )

    def serving(self) -> bool:
        return "requests on" in self.text() and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(patient(10))


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def _config_file(
    path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, state: Path, **extra: object
) -> Path:
    lines = [
        f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {prefix}, keepalive_s: 5}}",
        f"state_dir: {state}",
        f"signing_key: {keys.private}",
        f"key_id: {keys.key_id}",
        "status_poll_s: 1",
        "select_wait_s: 0.5",
        *(f"{key}: {json.dumps(value)}" for key, value in extra.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _spawn(children: list[Child], config: Path, log: Path) -> Child:
    child = Child(config, log)
    children.append(child)
    return child


def test_a_second_controller_refuses_naming_the_holder_and_a_rollout_is_made_once(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, children: list[Child]
) -> None:
    settings = operator_settings(broker, prefix)
    first = _spawn(
        children,
        _config_file(tmp_path / "a.yaml", broker, prefix, keys, tmp_path / "state-a"),
        tmp_path / "a.log",
    )
    first.wait_serving_or_exit()
    assert first.serving(), first.text()
    claim = read_lease(settings)
    assert claim is not None
    assert (claim.pid, claim.state_dir) == (first.proc.pid, str(tmp_path / "state-a"))

    # Another state directory (another host's controller), then the same one: both refused.
    for name, state in (("b", tmp_path / "state-b"), ("c", tmp_path / "state-a")):
        second = _spawn(
            children,
            _config_file(tmp_path / f"{name}.yaml", broker, prefix, keys, state),
            tmp_path / f"{name}.log",
        )
        assert second.proc.wait(patient(30)) == 1, second.text()
        (line,) = [ln for ln in second.text().splitlines() if ln.startswith("error:")]
        assert f"prefix {prefix} is held by controller {claim.holder}" in line
        assert f"pid {first.proc.pid} on {claim.host}, state_dir {tmp_path / 'state-a'}" in line
        assert "requests on" not in second.text()
    assert not (tmp_path / "state-b").exists()  # refused before it opened anything

    names = [f"s{i}" for i in range(4)]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        _start(settings, model, _request(model, names, rollout_id="once", waves="1,100%"))
        done = _wait_state(settings, "once", "DONE", "ABORTED")
        jobs = fleet.jobs()
    assert done["state"] == "DONE", done
    assert done["devices"] == {"ACTIVE": 4}
    assert jobs == {name: [done["job_id"]] for name in names}  # one job id each, the holder's


def test_two_controllers_started_at_once_leave_one_holder(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, children: list[Child]
) -> None:
    settings = operator_settings(broker, prefix)
    pair = [
        _spawn(
            children,
            _config_file(tmp_path / f"{n}.yaml", broker, prefix, keys, tmp_path / f"state-{n}"),
            tmp_path / f"{n}.log",
        )
        for n in ("x", "y")
    ]
    # Each either refuses (it read the other's claim), or loses its lease connection to the other
    # (both read it free; the broker closes the earlier connection of the lease's client id).
    wait_until(
        lambda: any(c.proc.poll() is not None for c in pair), timeout=60, what="one of the two to stop"
    )
    (gone,) = [c for c in pair if c.proc.poll() is not None]
    (holder,) = [c for c in pair if c is not gone]
    assert gone.proc.returncode == 1, gone.text()
    assert re.search(r"^error: .*(is held by|was taken by|lease connection)", gone.text(), re.M)
    holder.wait_serving_or_exit()
    assert holder.serving(), holder.text()
    claim = read_lease(settings)
    assert claim is not None
    assert claim.pid == holder.proc.pid

    names = ["t0", "t1"]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        _start(settings, model, _request(model, names, rollout_id="race"))
        done = _wait_state(settings, "race", "DONE", "ABORTED")
        jobs = fleet.jobs()
    assert done["state"] == "DONE", done
    assert jobs == {name: [done["job_id"]] for name in names}


def test_two_that_both_read_the_lease_free_end_with_the_later_one_holding_it(
    tmp_path: Path, broker: Broker, prefix: str
) -> None:
    """The race the claim cannot settle: both read it free, then both take it (``_take`` is the
    step after the read). The broker closes the earlier lease connection; nothing reconnects it by
    itself, and the earlier one's regain finds its lease taken (the broker closed that connection
    alone: its witness connection stayed up) and does not take it back."""
    settings = operator_settings(broker, prefix)
    earlier, later = PrefixLease(settings, tmp_path / "a"), PrefixLease(settings, tmp_path / "b")
    try:
        assert read_lease(settings) is None
        earlier._take(10)
        assert earlier.lost is None
        later._take(10)
        wait_until(lambda: earlier.lost is not None, what="the earlier holder to lose the lease")
        with pytest.raises(LeaseLostError, match=f"another controller may hold prefix {prefix}"):
            earlier.regain()
        assert earlier.lost_for_good is not None
        assert later.lost is None  # not closed by a regain of the earlier one
        earlier.release()  # must not clear the later one's claim
        held = read_lease(settings)
        assert held is not None
        assert held.holder == later.claim.holder
        assert later.lost is None
    finally:
        earlier.release()
        later.release()
    assert read_lease(settings) is None


def test_a_holder_that_lost_the_broker_finds_another_claim_when_it_is_back_and_does_not_take_it(
    tmp_path: Path, private_broker: Broker
) -> None:
    """Both lost the broker (a restart without persistence, so the claim went with it); the other
    took the lease first: the claim the regain reads is the other's, so the lease is lost for good."""
    prefix = unique_prefix()
    settings = operator_settings(private_broker, prefix)
    first, other = PrefixLease(settings, tmp_path / "a"), PrefixLease(settings, tmp_path / "b")
    try:
        assert first.acquire()
        private_broker.restart(hard=True)
        wait_until(lambda: first.lost is not None, what="the holder to see its lease connection drop")
        assert first.lost_for_good is None  # the broker went away: not known to be taken
        assert other.acquire()
        raised: list[LeaseLostError] = []

        def regained_or_lost() -> bool:
            try:
                return first.regain()  # False: not yet due (tries are spaced), try again
            except LeaseLostError as exc:
                raised.append(exc)
                return True

        wait_until(regained_or_lost, what="the regain's answer")
        assert raised, "the holder took the lease back from the other"
        assert f"was taken by controller {other.claim.holder}" in str(raised[0])
        assert other.lost is None
        held = read_lease(settings)
        assert held is not None
        assert held.holder == other.claim.holder
    finally:
        first.release()
        other.release()


@pytest.mark.slow
def test_a_standby_takes_over_from_a_killed_holder_and_finishes_its_rollout(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles, children: list[Child]
) -> None:
    """The standby shares the holder's state directory (as a second unit on the holder's storage
    would): that is how the open rollout reaches it."""
    settings = operator_settings(broker, prefix)
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
    assert f"pid {holder.proc.pid}" in standby.text()

    names = [f"k{i}" for i in range(3)]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("k2", False)  # the rollout stays open: k2 is offline
        _start(settings, model, _request(model, names, rollout_id="handover", on_timeout="wait"))
        wait_until(lambda: len(fleet.jobs()["k1"]) == 1, timeout=30, what="k1 ran its job")
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(patient(10))
        # The killed process's socket closes: the broker publishes its Last Will, which clears
        # the claim; the standby takes the lease and resumes the rollout from the store.
        standby.wait_serving_or_exit(timeout=60)
        assert standby.serving(), standby.text()
        assert "fleet.controller.resumed" in standby.text()
        fleet.set_online("k2", True)
        done = _wait_state(settings, "handover", "DONE", "ABORTED")
        jobs = fleet.jobs()
    assert done["state"] == "DONE", done
    assert done["devices"] == {"ACTIVE": 3}
    assert jobs == {name: [done["job_id"]] for name in names}
    claim = read_lease(settings)
    assert claim is not None
    assert claim.pid == standby.proc.pid


def test_a_holder_whose_lease_connection_is_taken_stops_and_does_not_take_it_back(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "state",
        signing_key=keys.private,
        key_id=keys.key_id,
    )
    loop = RunningController(config, catch=LeaseLostError)
    controller, raised = loop.controller, loop.raised
    assert isinstance(controller.lease, PrefixLease)
    try:
        with Probe(broker.host, broker.port, client_id=controller.lease.client_id) as taker:
            loop.thread.join(patient(30))
            assert not loop.thread.is_alive()
            assert raised, "the controller went on after losing its lease connection"
            # The line docs/protocol.md quotes ("... another controller may hold prefix P now; stopping").
            assert f"another controller may hold prefix {prefix} now; stopping" in str(raised[0])
            # The controller's lease connection did not come back and close the taker's.
            taker.settle(1.0)
            assert taker.client.is_connected()
    finally:
        loop.stop()


def test_the_lease_client_id_is_the_same_for_one_key_and_unguessable_without_it(tmp_path: Path) -> None:
    one, other = write_keypair(tmp_path / "one", "one"), write_keypair(tmp_path / "other", "other")
    secret = load_signing_key(one.private).private_bytes_raw()
    ours = lease_client_id("fleet/v1", secret)
    assert ours == lease_client_id("fleet/v1", load_signing_key(one.private).private_bytes_raw())
    assert ours != lease_client_id("fleet/v1", load_signing_key(other.private).private_bytes_raw())
    assert ours != lease_client_id("fleet/v2", secret)
    assert "fleet/v1" not in ours


def test_the_claim_is_renewed_while_the_controller_holds_the_lease(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    """A 3 s claim, and no loop running (as when one request keeps it busy): renewed all the same."""
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "state",
        signing_key=keys.private,
        key_id=keys.key_id,
        lease_ttl_s=3,
    )
    lease = ControllerTopics(prefix).lease
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(lease)
        controller = FleetController(config).start()
        try:
            # Four claims span more than the 3 s a claim lives unrenewed.
            claims = [decode(ControllerLease, m.payload) for m in probe.wait_for_count(lease, 4, timeout=30)]
            assert {c.holder for c in claims} == {controller.lease.claim.holder}
            held = read_lease(operator_settings(broker, prefix))
            assert held is not None
            assert held.holder == controller.lease.claim.holder
        finally:
            controller.stop()


def test_the_documented_lease_is_what_the_controller_publishes(
    tmp_path: Path, broker: Broker, prefix: str, keys: KeyPairFiles
) -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    example = re.search(r"<!-- lease example -->\n```json\n(.*?)```", doc, re.S)
    assert example, "docs/protocol.md has no lease example"
    documented = decode(ControllerLease, example.group(1).encode())
    # The refusal line the doc shows is the one the controller prints for that claim.
    refusal = f"error: prefix fleet/v1 is held by {describe(documented)}; one controller per prefix:"
    assert refusal in re.sub(r"\s*\n\s*", " ", doc)
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "state",
        signing_key=keys.private,
        key_id=keys.key_id,
    )
    controller = FleetController(config).start()
    try:
        with Probe(broker.host, broker.port) as probe:
            probe.subscribe(ControllerTopics(prefix).lease)
            (message,) = probe.wait_for_count(ControllerTopics(prefix).lease, 1)
        published = json.loads(message.payload)
        assert message.retain
        assert published["ttl_s"] == documented.ttl_s
        assert message.message_expiry_s is not None
        assert 0 < message.message_expiry_s <= published["ttl_s"]
        assert set(published) == set(json.loads(example.group(1)))
    finally:
        controller.stop()
    assert read_lease(operator_settings(broker, prefix)) is None  # a clean stop clears the claim
