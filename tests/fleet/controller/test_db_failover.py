"""Two controllers on two hosts with no shared disk: the store, the lease and the model repository in
a real PostgreSQL, real controller processes on a real mosquitto, scripted devices
(:mod:`tests.fleet.scripted_fleet`, a stand-in for the fleet) whose rollout asks for shadow and
probation. Each controller has a state directory of its own; the standby reaches the open rollouts
and the model only through the database.

The holder is killed mid-wave (SIGKILL), frozen past its lease and woken (SIGSTOP, SIGCONT), and cut
from the database for 10 s (:class:`tests.tcp_proxy.FreezableProxy`); each time the rollout ends with
one job per device, none skipped, one terminal state each.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fsutil import sha256_file
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, ends_only_shadow
from tests.fleet.controller.test_lease import Child, _config_file, _spawn
from tests.fleet.controller.test_process import _fleet, _request, _start, _wait_state
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.postgres_server import PostgresServer
from tests.tcp_proxy import FreezableProxy
from tests.waiting import patient, wait_until

#: How long the database is out of reach in the outage test (the scenario, not a wait for an event).
OUTAGE_S = 10.0


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
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGCONT)  # a frozen one too
        child.kill()


def _database(postgres: PostgresServer, name: str, port: int | None = None) -> dict[str, str]:
    return {"url": postgres.url(name, port), "password_file": str(postgres.password_file)}


def _guarded(model: Path, names: list[str], rollout_id: str) -> dict[str, Any]:
    """A rollout with shadow and probation on, as operators run them."""
    return _request(
        model,
        names,
        rollout_id=rollout_id,
        waves="2,100%",
        on_timeout="wait",
        shadow=ends_only_shadow(frames=30).model_dump(mode="json"),
        probation_s=5.0,
        probation=ENDS_ONLY_PROBATION.model_dump(mode="json"),
    )


def _pair(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    children: list[Child],
    postgres: PostgresServer,
    name: str,
    ttl_s: int,
    holder_port: int | None = None,
) -> tuple[Child, Child]:
    """A holder on host-a's state directory (reaching database ``name`` through ``holder_port``
    when given: a proxy the test can cut), then a standby on host-b's."""

    def spawn(host: str, port: int | None, standby: bool) -> Child:
        config = _config_file(
            tmp_path / f"{host}.yaml",
            broker,
            prefix,
            keys,
            tmp_path / f"host-{host}",
            database=_database(postgres, name, port),
            lease_ttl_s=ttl_s,
            standby=standby,
        )
        return _spawn(children, config, tmp_path / f"{host}.log")

    holder = spawn("a", holder_port, standby=False)
    holder.wait_serving_or_exit()
    assert holder.serving(), holder.text()
    standby = spawn("b", None, standby=True)
    wait_until(lambda: "standing by" in standby.text(), timeout=30, what="the standby's line")
    assert f"pid {holder.proc.pid}" in standby.text()
    return holder, standby


def _one_job_each(done: dict[str, Any], jobs: dict[str, list[str]], names: list[str]) -> None:
    assert done["state"] == "DONE", done
    assert done["devices"] == {"ACTIVE": len(names)}  # one terminal state each, none skipped
    assert jobs == {name: [done["job_id"]] for name in names}  # one job each, none twice


def _lease_row(postgres: PostgresServer, name: str) -> tuple[int, int]:
    with psycopg.connect(postgres.conninfo(name)) as pg:
        row = pg.execute("SELECT token, pid FROM controller_lease").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_standby_on_another_state_dir_finishes_the_rollout_of_a_holder_killed_mid_wave(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    children: list[Child],
    postgres: PostgresServer,
) -> None:
    name = postgres.new_database()
    holder, standby = _pair(
        tmp_path,
        broker,
        prefix,
        keys,
        children,
        postgres,
        name,
        ttl_s=5,
    )
    settings = operator_settings(broker, prefix)
    names = [f"k{i}" for i in range(5)]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("k1", False)  # the first wave stays open: k1 is offline
        _start(settings, model, _guarded(model, names, "handover"))
        wait_until(lambda: len(fleet.jobs()["k0"]) == 1, timeout=30, what="k0 ran its job")
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(patient(10))
        standby.wait_serving_or_exit(timeout=60)
        assert standby.serving(), standby.text()
        assert "fleet.controller.resumed" in standby.text()
        fleet.set_online("k1", True)
        done = _wait_state(settings, "handover", "DONE", "ABORTED")
        jobs = fleet.jobs()
    _one_job_each(done, jobs, names)
    # The second wave's manifests were made by the standby from the model it fetched from the database.
    sha = sha256_file(model)
    assert (tmp_path / "host-b" / "models" / f"{sha}.onnx").read_bytes() == model.read_bytes()
    assert "fleet.statedb.model_fetched" in standby.text()
    assert _lease_row(postgres, name) == (2, standby.proc.pid)


def test_a_holder_frozen_past_its_lease_cannot_write_when_it_wakes_and_steps_down(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    children: list[Child],
    postgres: PostgresServer,
) -> None:
    name = postgres.new_database()
    holder, standby = _pair(
        tmp_path,
        broker,
        prefix,
        keys,
        children,
        postgres,
        name,
        ttl_s=3,
    )
    settings = operator_settings(broker, prefix)
    names = [f"f{i}" for i in range(5)]
    model = tiny_model(tmp_path / "m.onnx")
    with _fleet(broker, prefix, keys, names) as fleet:
        fleet.set_online("f1", False)
        _start(settings, model, _guarded(model, names, "frozen"))
        wait_until(lambda: len(fleet.jobs()["f0"]) == 1, timeout=30, what="f0 ran its job")
        holder.proc.send_signal(signal.SIGSTOP)
        try:
            standby.wait_serving_or_exit(timeout=60)  # the frozen holder's lease expired: taken over
        finally:
            holder.proc.send_signal(signal.SIGCONT)
        assert standby.serving(), standby.text()
        holder.proc.wait(patient(60))  # it wakes up, finds its token fenced, and steps down
        assert holder.proc.returncode != 0
        # It learns it from its renewal (lease.lost) or from its next write, refused (lease.fenced).
        assert any(
            mark in holder.text()
            for mark in ("fleet.controller.lease.lost", "fleet.controller.lease.fenced", "lease_fenced")
        )
        assert "is fenced" in holder.text() or "the write was refused" in holder.text()
        fleet.set_online("f1", True)
        done = _wait_state(settings, "frozen", "DONE", "ABORTED")
        jobs = fleet.jobs()
    _one_job_each(done, jobs, names)
    assert _lease_row(postgres, name) == (2, standby.proc.pid)


def test_a_holder_cut_from_the_database_for_10_s_keeps_nothing_half_written_and_resumes(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    children: list[Child],
    postgres: PostgresServer,
) -> None:
    name = postgres.new_database()
    proxy = FreezableProxy("127.0.0.1", postgres.port).start()
    try:
        holder, standby = _pair(
            tmp_path,
            broker,
            prefix,
            keys,
            children,
            postgres,
            name,
            holder_port=proxy.port,
            ttl_s=30,  # longer than the outage: the holder keeps the lease and goes on
        )
        settings = operator_settings(broker, prefix)
        names = [f"c{i}" for i in range(5)]
        model = tiny_model(tmp_path / "m.onnx")
        with _fleet(broker, prefix, keys, names) as fleet:
            fleet.set_online("c1", False)
            _start(settings, model, _guarded(model, names, "cut"))
            wait_until(lambda: len(fleet.jobs()["c0"]) == 1, timeout=30, what="c0 ran its job")
            proxy.refuse()
            proxy.cut()
            wait_until(
                lambda: "fleet.controller.lease.paused" in holder.text(),
                timeout=30,
                what="the holder pausing on the lost database",
            )
            fleet.set_online("c1", True)  # its job ends while the holder cannot write it down
            threading.Event().wait(OUTAGE_S)
            proxy.refuse(False)
            done = _wait_state(settings, "cut", "DONE", "ABORTED")
            jobs = fleet.jobs()
        _one_job_each(done, jobs, names)
        assert holder.serving(), holder.text()
        assert "fleet.controller.lease.resumed" in holder.text()
        assert "fleet.controller.reloaded" in holder.text()
        assert "standing by" in standby.text()
        assert not standby.serving()
        assert _lease_row(postgres, name) == (1, holder.proc.pid)
    finally:
        proxy.close()


def test_a_holder_cut_from_the_database_longer_than_its_lease_hands_over_and_steps_down_when_back(
    tmp_path: Path,
    broker: Broker,
    prefix: str,
    keys: KeyPairFiles,
    children: list[Child],
    postgres: PostgresServer,
) -> None:
    """The same 10 s cut with a 3 s lease: the standby (which still reaches the database) takes over
    and finishes; the holder, back, finds its token taken and stops without writing."""
    name = postgres.new_database()
    proxy = FreezableProxy("127.0.0.1", postgres.port).start()
    try:
        holder, standby = _pair(
            tmp_path,
            broker,
            prefix,
            keys,
            children,
            postgres,
            name,
            holder_port=proxy.port,
            ttl_s=3,
        )
        settings = operator_settings(broker, prefix)
        names = [f"h{i}" for i in range(5)]
        model = tiny_model(tmp_path / "m.onnx")
        with _fleet(broker, prefix, keys, names) as fleet:
            fleet.set_online("h1", False)
            _start(settings, model, _guarded(model, names, "handed"))
            wait_until(lambda: len(fleet.jobs()["h0"]) == 1, timeout=30, what="h0 ran its job")
            proxy.refuse()
            proxy.cut()
            standby.wait_serving_or_exit(timeout=60)
            assert standby.serving(), standby.text()
            threading.Event().wait(OUTAGE_S)
            proxy.refuse(False)
            holder.proc.wait(patient(60))  # back: its token is another's, it stops
            assert holder.proc.returncode != 0
            assert "is fenced" in holder.text()
            fleet.set_online("h1", True)
            done = _wait_state(settings, "handed", "DONE", "ABORTED")
            jobs = fleet.jobs()
        _one_job_each(done, jobs, names)
        assert _lease_row(postgres, name) == (2, standby.proc.pid)
    finally:
        proxy.close()
