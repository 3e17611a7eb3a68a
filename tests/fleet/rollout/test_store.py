"""Rollout state in a real SQLite file and a real PostgreSQL (each test runs on both where it is not
about the file): transitions, overlap, resume, and a SIGKILL mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceStep, RolloutPlan, RolloutState, WaveState
from agent.fleet.rollout.store import (
    SCHEMA_VERSION,
    OverlapError,
    RolloutStore,
    RolloutStoreError,
    StoreDamagedError,
)
from agent.fleet.statedb.migrations import LATEST, MIGRATIONS
from agent.transitions import IllegalTransitionError
from tests.fleet.store_sites import StoreSite, open_store
from tests.postgres_server import PostgresServer
from tests.waiting import patient

ROOT = Path(__file__).resolve().parents[3]


def _plan(
    rollout_id: str, devices: list[list[str]], slot: str = "main", supersedes: str | None = None
) -> RolloutPlan:
    return RolloutPlan(
        rollout_id,
        slot,
        f"job-{rollout_id}",
        "5",
        devices,
        from_versions={device: "4" for wave in devices for device in wave},
        spec={"waves": "1,100%", "max_failed": "0"},
        supersedes=supersedes,
    )


@pytest.fixture
def store(store_site: StoreSite) -> Iterator[RolloutStore]:
    opened = store_site.open()
    yield opened
    opened.close()


def test_a_new_rollout_is_stored_with_its_waves_and_devices_planned(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"], ["b", "c"]]))
    assert store.rollout("r1").state is RolloutState.RUNNING
    assert store.rollout("r1").spec == {"waves": "1,100%", "max_failed": "0"}
    rows = store.devices("r1")
    assert [(r.device, r.wave, r.from_version, r.to_version, r.job_id, r.step) for r in rows] == [
        ("a", 0, "4", "5", "job-r1", DeviceStep.PLANNED),
        ("b", 1, "4", "5", "job-r1", DeviceStep.PLANNED),
        ("c", 1, "4", "5", "job-r1", DeviceStep.PLANNED),
    ]
    assert [state for state, _, _ in store.waves("r1")] == [WaveState.WAITING, WaveState.WAITING]
    assert store.resume("r1").wave is None


def test_resume_sorts_the_current_waves_devices_by_step(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a", "b", "c", "d"], ["e"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    store.mark_sending("r1", "a")
    store.mark_sent("r1", "a")
    store.record_job("r1", "a", DeviceEnd.ACTIVE)
    store.mark_sending("r1", "b")
    store.mark_sent("r1", "b")
    store.mark_sending("r1", "c")
    point = store.resume("r1")
    assert (point.wave, point.wave_state) == (0, WaveState.RUNNING)
    assert (point.to_send, point.resend, point.waiting, point.ended) == (("d",), ("c",), ("b",), ("a",))


def test_a_job_status_keeps_figures_and_a_final_one_ends_the_device(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    store.mark_sending("r1", "a")
    store.mark_sent("r1", "a")
    store.record_job("r1", "a", DeviceEnd.PENDING, {"shadow": {"frames": 10, "agreement": 0.9}})
    assert store.devices("r1")[0].step is DeviceStep.SENT
    store.record_job("r1", "a", DeviceEnd.ROLLED_BACK, {"probation": {"failed": "p99_ratio"}})
    row = store.devices("r1")[0]
    # The final status lacks the shadow figures an earlier one carried: they are kept beside its own.
    both = {"shadow": {"frames": 10, "agreement": 0.9}, "probation": {"failed": "p99_ratio"}}
    assert (row.step, row.end, row.figures) == (DeviceStep.ENDED, DeviceEnd.ROLLED_BACK, both)
    assert row.sent_at is not None
    assert row.ended_at is not None
    # A late status of a job that ended changes nothing.
    store.record_job("r1", "a", DeviceEnd.PENDING, {"late": True})
    assert store.devices("r1")[0].figures == both


def test_a_resend_of_a_sent_device_counts_without_moving_it(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a", "b", "c"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    for device in ("a", "b", "c"):
        store.mark_sending("r1", device)
    store.mark_sent("r1", "a")
    store.mark_sent("r1", "b")
    store.mark_sending("r1", "c")  # c was SENDING at a crash: published again
    store.mark_resent("r1", ["a"], "published again after a controller restart")
    store.mark_resent("r1", [], "nothing")
    rows = {row.device: row for row in store.devices("r1")}
    assert {d: (r.step, r.sends) for d, r in rows.items()} == {
        "a": (DeviceStep.SENT, 2),
        "b": (DeviceStep.SENT, 1),
        "c": (DeviceStep.SENDING, 2),
    }
    assert [d for what, d in store.events("r1") if what == "resent"] == [
        {"devices": 1, "why": "published again after a controller restart"}
    ]


def test_an_illegal_transition_is_refused_and_changes_nothing(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"]]))
    with pytest.raises(
        IllegalTransitionError, match="rollout r1 device a: illegal rollout device transition PLANNED -> SENT"
    ):
        store.mark_sent("r1", "a")
    store.set_state("r1", RolloutState.DONE)
    with pytest.raises(IllegalTransitionError, match="DONE -> RUNNING"):
        store.set_state("r1", RolloutState.RUNNING)
    with pytest.raises(RolloutStoreError, match="rollout r1 has no device zz"):
        store.mark_sending("r1", "zz")
    assert store.devices("r1")[0].step is DeviceStep.PLANNED


def test_an_overlapping_rollout_on_the_same_slot_is_refused_naming_the_devices(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a", "b"], ["c"]]))
    with pytest.raises(
        OverlapError, match=r"rollout r1 still owns slot 'main' on 2 of these devices: a, c"
    ) as caught:
        store.create(_plan("r2", [["c", "x", "a"]]))
    assert caught.value.devices == ("a", "c")
    assert caught.value.rollout_id == "r1"
    with pytest.raises(RolloutStoreError, match="no rollout r2"):
        store.rollout("r2")
    # Another slot, or devices r1 does not hold, are fine.
    store.create(_plan("r3", [["a"]], slot="aux"))
    store.create(_plan("r4", [["x", "y"]]))


def test_a_device_that_ended_still_belongs_to_its_open_rollout(store: RolloutStore) -> None:
    """An abort with rollback may still move it back; a second rollout would contradict that."""
    store.create(_plan("r1", [["a"], ["b"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    store.mark_sending("r1", "a")
    store.mark_sent("r1", "a")
    store.record_job("r1", "a", DeviceEnd.ACTIVE)
    with pytest.raises(OverlapError, match="on 1 of these devices: a"):
        store.create(_plan("r2", [["a"]]))


def test_a_paused_rollout_still_owns_its_devices_and_a_finished_one_does_not(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"]]))
    store.set_state("r1", RolloutState.PAUSED, "operator")
    with pytest.raises(OverlapError):
        store.create(_plan("r2", [["a"]]))
    store.set_state("r1", RolloutState.RUNNING)
    store.set_state("r1", RolloutState.ABORTED, "gate tripped")
    store.create(_plan("r2", [["a"]]))
    assert store.open_rollouts() == ["r2"]


def test_superseding_ends_the_old_rollout_and_cancels_its_unsent_devices(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"], ["b"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    store.mark_sending("r1", "a")
    store.mark_sent("r1", "a")
    store.create(_plan("r2", [["a", "b"]], supersedes="r1"))
    old = store.rollout("r1")
    assert (old.state, old.reason) == (RolloutState.SUPERSEDED, "superseded by r2")
    assert [(r.device, r.step) for r in store.devices("r1")] == [
        ("a", DeviceStep.SENT),
        ("b", DeviceStep.CANCELLED),
    ]
    assert [state for state, _, _ in store.waves("r1")] == [WaveState.CANCELLED, WaveState.CANCELLED]
    assert store.open_rollouts() == ["r2"]
    assert ("superseded", {"by": "r2"}) in store.events("r1")


def test_aborting_cancels_the_devices_not_yet_sent(store: RolloutStore) -> None:
    store.create(_plan("r1", [["a"], ["b", "c"]]))
    store.set_wave("r1", 0, WaveState.RUNNING)
    store.mark_sending("r1", "a")
    store.set_wave("r1", 0, WaveState.TRIPPED, figures={"failed": 1, "limit": 0}, reason="gate trips")
    store.set_state("r1", RolloutState.ABORTED, "gate trips")
    assert [r.step for r in store.devices("r1")] == [
        DeviceStep.SENDING,
        DeviceStep.CANCELLED,
        DeviceStep.CANCELLED,
    ]
    assert store.waves("r1") == [
        (WaveState.TRIPPED, {"failed": 1, "limit": 0}, "gate trips"),
        (WaveState.CANCELLED, None, "cancelled: gate trips"),  # why it never ran
    ]


def test_the_store_reopens_with_its_rollouts_and_refuses_a_newer_schema(store_site: StoreSite) -> None:
    first = store_site.open()
    first.create(_plan("r1", [["a"]]))
    first.close()
    second = store_site.open()
    assert second.open_rollouts() == ["r1"]
    second.close()
    if store_site.kind == "sqlite":
        newer = SCHEMA_VERSION + 1
        with sqlite3.connect(store_site.address) as db:
            db.execute(f"PRAGMA user_version={newer}")
    else:
        newer = LATEST + 1
        with psycopg.connect(store_site.address, autocommit=True) as pg:
            pg.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (newer,))
    with pytest.raises(RolloutStoreError, match=f"schema {newer} was written by a newer controller"):
        store_site.open()


def test_four_controllers_opening_a_new_postgresql_store_at_once_migrate_it_once(
    postgres: PostgresServer,
) -> None:
    address = postgres.conninfo(postgres.new_database())
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: open_store(address), range(4)))
    stores[0].create(_plan("r1", [["a"]]))
    assert [s.open_rollouts() for s in stores] == [["r1"]] * 4
    for opened in stores:
        opened.close()
    with psycopg.connect(address) as pg:
        applied = pg.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        assert applied == [(version,) for version, _ in MIGRATIONS]  # each once


def test_a_store_file_that_is_not_sqlite_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.sqlite"
    path.write_bytes(b"not a database, just some bytes" * 100)
    with pytest.raises(StoreDamagedError, match=r"rollouts\.sqlite is damaged \(file is not a database\)"):
        RolloutStore(path)


def _driver(db: str, log: Path, count: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fleet.rollout.driver", db, str(log), str(count)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


_STEP_OF_LINE = {"sending": DeviceStep.SENDING, "sent": DeviceStep.SENT, "ended": DeviceStep.ENDED}
_ORDER = [DeviceStep.PLANNED, DeviceStep.SENDING, DeviceStep.SENT, DeviceStep.ENDED]


@pytest.mark.parametrize("kill_after", [4, 170, 330, 520])
def test_a_controller_killed_mid_write_resumes_with_no_device_sent_twice_or_skipped(
    tmp_path: Path, store_site: StoreSite, kill_after: int
) -> None:
    """SIGKILL a real child process writing transitions; the store reopens at a transition boundary.

    Every transition the child reported as committed is in the store, at most one more is, each
    device's log of events matches its step (row and event share one transaction), and a second
    run resumes: every device is published, with one job id, and only a device caught in SENDING
    is published again (the same retained desired state, not a second job).
    """
    db, log, count = store_site.address, tmp_path / "published.log", 200
    child = _driver(db, log, count)
    assert child.stdout is not None
    reported: dict[str, DeviceStep] = {}
    read = 0
    while read < kill_after:
        line = child.stdout.readline().split()
        assert line, "the child ended before it was killed"
        assert line[0] != "done", "the child finished before it was killed"
        # Only the driver's lines count: the store logs each migration it applies on stdout too.
        read += line[0] in (*_STEP_OF_LINE, "wave")
        if line[0] in _STEP_OF_LINE:
            reported[line[1]] = _STEP_OF_LINE[line[0]]
    os.kill(child.pid, signal.SIGKILL)
    # What it printed before it died was committed too: read the rest of the pipe.
    for rest in child.stdout.read().splitlines():
        line = rest.split()
        if line[0] in _STEP_OF_LINE:
            reported[line[1]] = _STEP_OF_LINE[line[0]]
    child.wait(timeout=patient(10))
    assert child.returncode == -signal.SIGKILL

    store = store_site.open()
    assert store.check() == []
    rows = {row.device: row for row in store.devices("r1")}
    ahead = []
    for device, row in rows.items():
        told = _ORDER.index(reported.get(device, DeviceStep.PLANNED))
        stored = _ORDER.index(row.step)
        assert stored >= told, f"{device}: reported {reported.get(device)} but the store has {row.step}"
        if stored > told:
            ahead.append(device)
        events = [d for what, d in store.events("r1") if what == "device" and d["device"] == device]
        assert len(events) == stored, f"{device}: {row.step} with {len(events)} device events"
    # Killed between a commit and its line, the store is one transition ahead for one device at most.
    assert len(ahead) <= 1, ahead
    point = store.resume("r1")
    if point.wave is not None:
        current = [r.device for r in rows.values() if r.wave == point.wave]
        assert sorted((*point.to_send, *point.resend, *point.waiting, *point.ended)) == sorted(current)
    store.close()

    again = _driver(db, log, count)
    out, _ = again.communicate(timeout=patient(60))
    assert again.returncode == 0
    assert out.splitlines()[-1] == "done"
    store = store_site.open()
    assert store.rollout("r1").state is RolloutState.DONE
    assert all((r.step, r.end) == (DeviceStep.ENDED, DeviceEnd.ACTIVE) for r in store.devices("r1"))
    published = [line.split() for line in log.read_text().splitlines()]
    assert {job for _, job in published} == {"job-r1"}
    times = Counter(device for device, _ in published)
    assert set(times) == {f"jet-{i:04d}" for i in range(count)}, "a device was skipped"
    twice = {device for device, n in times.items() if n > 1}
    assert len(twice) <= 1
    assert max(times.values()) <= 2
    resent = {r.device for r in store.devices("r1") if r.sends > 1}
    assert twice <= resent
    store.close()


def test_a_database_an_older_controller_made_is_migrated_in_order_keeping_its_rollouts(
    postgres: PostgresServer,
) -> None:
    address = postgres.conninfo(postgres.new_database())
    with psycopg.connect(address, autocommit=True) as pg, pg.transaction():  # as the first release left it
        pg.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ)")
        pg.execute(MIGRATIONS[0][1].encode())
        pg.execute("INSERT INTO schema_migrations (version) VALUES (1)")
    with psycopg.connect(address, autocommit=True) as pg:
        pg.execute(
            "INSERT INTO rollouts (id, slot, job_id, to_version, state, spec, created_at, updated_at) "
            "VALUES ('old', 'main', 'job-old', '4', 'RUNNING', '{}', 1, 1)"
        )
    store = open_store(address)
    assert store.open_rollouts() == ["old"]
    store.close()
    with psycopg.connect(address) as pg:
        versions = [r[0] for r in pg.execute("SELECT version FROM schema_migrations ORDER BY version")]
        assert versions == [version for version, _ in MIGRATIONS]
        assert pg.execute("SELECT count(*) FROM engine_index").fetchone() == (0,)
        assert pg.execute("SELECT count(*) FROM samples").fetchone() == (0,)
