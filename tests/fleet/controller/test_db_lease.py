"""The lease in PostgreSQL (controller/db_lease.py) and the token that fences every write, on a real
PostgreSQL started by the tests: one holder at a time, a standby that takes an expired lease, and a
holder whose lease was taken that can write nothing more (its transition refused whole, its sample
not kept)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient, RequestRefusedError
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.db_lease import DatabaseLease
from agent.fleet.controller.lease import LeaseHeldError, LeaseLostError
from agent.fleet.rollout.pg_store import PostgresRolloutStore
from agent.fleet.rollout.records import DeviceStep, RolloutPlan, RolloutState, WaveState
from agent.fleet.samples.pg_store import PostgresSampleStore
from agent.fleet.samples.store import SampleBounds
from agent.fleet.statedb.models import ModelVault
from agent.fleet.statedb.postgres import IDLE_IN_TRANSACTION_S, DatabaseError, FencedError, StateDatabase
from agent.fsutil import sha256_file
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.fleet.samples.made import low_class, made_sample
from tests.postgres_server import PostgresServer
from tests.waiting import patient, wait_until


@pytest.fixture
def address(postgres: PostgresServer) -> str:
    address = postgres.conninfo(postgres.new_database())
    StateDatabase(address).migrate()
    return address


@pytest.fixture
def leases(address: str, tmp_path: Path) -> Iterator[list[DatabaseLease]]:
    made: list[DatabaseLease] = []
    yield made
    for lease in made:
        lease.release()


def _lease(leases: list[DatabaseLease], address: str, state: Path, ttl_s: int = 30) -> DatabaseLease:
    lease = DatabaseLease(StateDatabase(address, name="lease"), "fleet-a", state, ttl_s=ttl_s)
    leases.append(lease)
    return lease


def _expire(address: str) -> None:
    """What a holder frozen (SIGSTOP) past its ttl leaves: a row the database's clock says expired."""
    with psycopg.connect(address, autocommit=True) as pg:
        pg.execute("UPDATE controller_lease SET expires_at = clock_timestamp() - interval '1 second'")


def _plan() -> RolloutPlan:
    return RolloutPlan("r1", "main", "job-r1", "5", [["a", "b"]], spec={"waves": "1,100%"})


def test_a_second_controller_is_refused_naming_the_holder_and_a_standby_takes_the_lease_once_it_expires(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    first = _lease(leases, address, tmp_path / "one")
    assert first.acquire()
    assert first.fence is not None
    assert first.lost is None
    second = _lease(leases, address, tmp_path / "two")
    with pytest.raises(
        LeaseHeldError, match=rf"held by controller {first.claim.holder}.*state_dir {tmp_path}/one"
    ):
        second.acquire()
    took = threading.Event()

    def stand_by() -> None:
        if second.acquire(standby=True):
            took.set()

    standby = threading.Thread(target=stand_by, daemon=True)
    standby.start()
    assert not took.wait(0.5)  # the holder renews: the standby waits
    _expire(address)
    standby.join(patient(30))
    assert took.is_set()
    assert second.fence is not None
    assert second.fence.token == first.fence.token + 1
    with pytest.raises(LeaseLostError, match=rf"taken by {second.claim.holder}"):
        first.regain()
    assert first.lost_for_good is not None


def test_a_holder_whose_lease_was_taken_writes_nothing_and_its_transition_is_refused_whole(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    first = _lease(leases, address, tmp_path / "one")
    assert first.acquire()
    old = PostgresRolloutStore(StateDatabase(address), fence=first.fence)
    old.create(_plan())
    old.set_wave("r1", 0, WaveState.RUNNING)
    old.mark_sending("r1", "a")
    _expire(address)  # frozen past its ttl ...
    second = _lease(leases, address, tmp_path / "two")
    assert second.acquire()  # ... and a standby took over
    new = PostgresRolloutStore(StateDatabase(address), fence=second.fence)
    before = (new.devices("r1"), new.events("r1"))

    assert first.fence is not None
    with pytest.raises(
        FencedError, match=rf"token {first.fence.token}\) was taken: it is held by {second.claim.holder}"
    ):
        old.mark_sent("r1", "a")  # the holder wakes up and goes on where it was
    with pytest.raises(FencedError):
        old.mark_sending("r1", "b")
    assert old.fenced_writes == 2
    assert (new.devices("r1"), new.events("r1")) == before
    assert new.mark_sent("r1", "a") == "job-r1"  # the new holder goes on from the same state
    assert [r.step for r in new.devices("r1")] == [DeviceStep.SENT, DeviceStep.PLANNED]
    old.close()
    new.close()


def test_a_holder_whose_lease_was_taken_keeps_no_sample_and_evicts_none(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    first = _lease(leases, address, tmp_path / "one")
    assert first.acquire()
    bounds = SampleBounds(max_count=1)
    old = PostgresSampleStore(StateDatabase(address), bounds, fence=first.fence)
    kept = old.add("cam-1", made_sample(low_class(), 1))
    _expire(address)
    second = _lease(leases, address, tmp_path / "two")
    assert second.acquire()
    new = PostgresSampleStore(StateDatabase(address), bounds, fence=second.fence)
    try:
        with pytest.raises(FencedError, match="was taken"):
            old.add("cam-2", made_sample(low_class(), 2))  # would have evicted cam-1's
        assert new.samples() == [kept]
        assert old.evicted == 0
        assert new.add("cam-2", made_sample(low_class(), 2)) is not None  # the holder's add goes in
        assert [s.device for s in new.samples()] == ["cam-2"]
    finally:
        old.close()
        new.close()


def test_a_released_lease_is_taken_at_once_and_its_token_keeps_counting(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    first = _lease(leases, address, tmp_path / "one")
    assert first.acquire()
    assert first.fence is not None
    first.release()
    second = _lease(leases, address, tmp_path / "two")
    assert second.acquire()
    assert second.fence is not None
    assert second.fence.token == first.fence.token + 1


def test_a_model_is_kept_in_the_database_whole_and_fetched_checked_by_another_controller(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    holder = _lease(leases, address, tmp_path / "one")
    assert holder.acquire()
    model = tmp_path / "one" / "m.onnx"
    model.parent.mkdir()
    model.write_bytes(bytes(range(256)) * 40_000)  # 10 MB: three chunks
    sha = sha256_file(model)
    vault = ModelVault(StateDatabase(address), fence=holder.fence)
    assert vault.put(sha, model)
    assert not vault.put(sha, model)  # once
    other = ModelVault(StateDatabase(address))
    fetched = tmp_path / "two" / "models" / f"{sha}.onnx"
    assert other.fetch(sha, fetched)
    assert fetched.read_bytes() == model.read_bytes()
    assert not other.fetch("0" * 64, tmp_path / "two" / "models" / "none.onnx")
    with psycopg.connect(address, autocommit=True) as pg:  # a damaged copy is refused, nothing written
        pg.execute("UPDATE model_chunks SET data = 'x'::bytea WHERE idx = 1")
    damaged = tmp_path / "three" / f"{sha}.onnx"
    with pytest.raises(DatabaseError, match=f"model {sha[:12]} .* hashes to"):
        other.fetch(sha, damaged)
    assert list(damaged.parent.iterdir()) == []
    _expire(address)  # the holder frozen past its lease; a standby takes it
    assert _lease(leases, address, tmp_path / "two").acquire()
    later = tmp_path / "one" / "later.onnx"
    later.write_bytes(b"a model uploaded to the stale holder")
    with pytest.raises(FencedError):
        vault.put(sha256_file(later), later)
    assert not other.has(sha256_file(later))  # no model row: it does not exist for anyone


#: A holder that takes the lease (ttl 2 s), checks its token in a transaction, then stops itself
#: (SIGSTOP) before the transaction's next statement: the lease row stays locked FOR SHARE.
_FROZEN_HOLDER = """
import os, signal, sys
from pathlib import Path
from agent.fleet.controller.db_lease import DatabaseLease
from agent.fleet.statedb.postgres import StateDatabase
lease = DatabaseLease(StateDatabase(sys.argv[1], name="lease"), "fleet-a", Path(sys.argv[2]), ttl_s=2)
assert lease.acquire()
with StateDatabase(sys.argv[1]).transaction(lease.fence) as sql:
    sql.execute("SELECT 1")
    print(lease.fence.token, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    sql.execute("SELECT 2")
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_holder_frozen_inside_a_guarded_transaction_keeps_a_standby_waiting_only_the_servers_bound(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    """A holder process stopped between two statements of a guarded write keeps the lease row locked,
    and its kernel keeps its connection alive: the server ends that session once it has sat idle in
    its transaction for IDLE_IN_TRANSACTION_S, so the standby takes over instead of waiting for ever."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_HOLDER, address, str(tmp_path / "one")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        lines = iter(holder.stdout.readline, "")
        token = int(next(line for line in lines if line.strip().isdigit()))  # after its log lines
        wait_until(lambda: _stopped(holder.pid), timeout=30, what="the holder stopped in its transaction")
        second = _lease(leases, address, tmp_path / "two")
        took = threading.Event()

        def stand_by() -> None:
            if second.acquire(standby=True):
                took.set()

        threading.Thread(target=stand_by, daemon=True).start()
        wait_until(took.is_set, timeout=IDLE_IN_TRANSACTION_S + 30, what="the standby's takeover")
        assert second.fence is not None
        assert second.fence.token == token + 1
    finally:
        holder.kill()
        holder.wait(patient(30))


def test_a_takeover_waits_for_a_write_in_flight_which_commits_and_the_next_one_is_refused(
    address: str, leases: list[DatabaseLease], tmp_path: Path
) -> None:
    """The fence's ordering: the standby's UPDATE of the lease row waits for the holder's transaction
    that checked the token (FOR SHARE), so that write is whole and before the takeover, and none after."""
    first = _lease(leases, address, tmp_path / "one")
    assert first.acquire()
    assert first.fence is not None
    database = StateDatabase(address)
    _expire(address)
    second = _lease(leases, address, tmp_path / "two")
    took = threading.Event()
    with database.transaction(first.fence) as sql:  # the token checked: a transition in flight
        sql.execute("CREATE TABLE written_in_flight (n INTEGER)")

        def take() -> None:
            if second.acquire():
                took.set()

        taker = threading.Thread(target=take, daemon=True)
        taker.start()
        with psycopg.connect(address, autocommit=True) as watcher:
            wait_until(
                lambda: (
                    watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'edge-fleet-lease' "
                        "AND wait_event_type = 'Lock'"
                    ).fetchone()
                    == (1,)
                ),
                timeout=30,
                what="the standby's takeover waiting for the holder's transaction",
            )
        assert not took.is_set()
        sql.execute("INSERT INTO written_in_flight VALUES (1)")
    taker.join(patient(30))
    assert took.is_set()
    with psycopg.connect(address) as pg:
        assert pg.execute("SELECT n FROM written_in_flight").fetchall() == [(1,)]
    with pytest.raises(FencedError), database.transaction(first.fence) as sql:
        sql.execute("INSERT INTO written_in_flight VALUES (2)")
    database.close()


def test_a_request_whose_write_is_fenced_is_refused_and_the_controller_stops_before_another(
    tmp_path: Path, broker: Broker, postgres: PostgresServer
) -> None:
    """A real controller on PostgreSQL whose lease a standby took while it could not tell (the row's
    token moved on): the operator's pause is refused with ``lease_fenced``, nothing of it is stored,
    and the loop stops (LeaseLostError) instead of handling one more request or step."""
    prefix, name = unique_prefix(), postgres.new_database()
    settings = operator_settings(broker, prefix)
    config = ControllerConfig.model_validate(
        {
            "mqtt": settings.model_dump(),
            "state_dir": str(tmp_path / "state"),
            "unsigned": True,
            "lease_ttl_s": 3600,  # no renewal during the test: the write is what meets the new token
            "database": {"url": postgres.url(name), "password_file": str(postgres.password_file)},
        }
    )
    running = RunningController(config, catch=LeaseLostError)
    try:
        store = running.controller.store
        assert store is not None
        store.create(_plan())
        with psycopg.connect(postgres.conninfo(name), autocommit=True) as pg:
            pg.execute("UPDATE controller_lease SET token = token + 1, holder = 'ops-2:77:standby'")
        with (
            ControllerClient(settings, timeout=patient(20)) as client,
            pytest.raises(RequestRefusedError, match="ops-2:77:standby") as refused,
        ):
            client.request("pause", {"rollout_id": "r1"})
        assert refused.value.code == "lease_fenced"
        wait_until(lambda: bool(running.raised), timeout=20, what="the controller's loop stopping")
        assert isinstance(running.raised[0], LeaseLostError)
    finally:
        running.stop()
    check = PostgresRolloutStore(StateDatabase(postgres.conninfo(name)))
    assert check.rollout("r1").state is RolloutState.RUNNING
    assert [what for what, _ in check.events("r1")] == ["created"]
    check.close()
