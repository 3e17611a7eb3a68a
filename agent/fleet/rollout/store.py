"""Rollout state in SQLite: rollouts, their waves, every device's step and end, and a log of transitions.

The fleet controller keeps nothing that matters only in memory: each transition (a wave starts, a
device's desired state is about to be sent, was sent, its job ended, a wave's gate held or tripped,
the rollout paused, aborted, finished, was superseded) is one SQLite transaction, in WAL mode with
``synchronous=FULL``, together with its row in ``events``. A ``kill -9`` or a power cut therefore
leaves the store at a transition boundary, never between the two halves of one.

How a restarted controller deploys no device twice and skips none: a device goes ``PLANNED ->
SENDING -> SENT -> ENDED``. ``SENDING`` is written *before* the signed desired state is published,
``SENT`` after the broker acknowledged it. After a crash, :meth:`RolloutStore.resume` lists the
current wave's devices by step: ``PLANNED`` ones were never published (send them), ``SENDING`` ones
may or may not have been (publish them again with the *same* job id and manifest: the desired state
is retained and idempotent, so a device that already has it sees the same job, not a second one),
``SENT`` ones wait for their job's end, ``ENDED`` ones are done.

One rollout per slot and device at a time: :meth:`RolloutStore.create` refuses a rollout whose
devices overlap a running or paused rollout on the same slot (:class:`OverlapError` names the
devices), unless it names that rollout in ``supersedes``: then, in the same transaction, the old
rollout ends ``SUPERSEDED`` and its unsent devices are cancelled.

The file itself: the schema is versioned (``PRAGMA user_version``); a store written by a newer
controller is refused. A damaged file is never used: opening runs ``PRAGMA quick_check``, and any
SQLite error that says the file is damaged, at open or later, is a :class:`StoreDamagedError` naming
the file and what to do. A new store is built beside its path and linked into place whole, so a
0-byte file at the path was emptied by something else (a failed restore, a disk fault) and is
refused, not taken for a new store. A full disk fails one transition (:class:`StoreFullError`,
nothing half-written) and is logged once per episode; the WAL is kept small (checkpointed every
:data:`WAL_CHECKPOINT_PAGES` pages, truncated to :data:`WAL_LIMIT_BYTES`) and truncated whenever
free space is short or a write failed, so the space freed after a full disk is enough for the next
transition (docs/fleet.md "Failure modes"). The states and rows are :mod:`agent.fleet.rollout.records`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from agent.errors import AgentError
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import (
    DEVICE_MOVES,
    OPEN_STATES,
    ROLLOUT_MOVES,
    WAVE_MOVES,
    DeviceRow,
    DeviceStep,
    ResumePoint,
    RolloutPlan,
    RolloutRow,
    RolloutState,
    WaveRow,
    WaveState,
)
from agent.fleet.statedb.sql import Sql
from agent.fsutil import fsync_directory

log = structlog.get_logger(__name__)

#: Version of the tables below; bump it with a migration in :meth:`RolloutStore._migrate`.
SCHEMA_VERSION = 1
#: The WAL is copied into the database every this many pages (SQLite's default, 1,000 pages of 4 KiB,
#: let the WAL alone fill a 4 MB disk before its first checkpoint).
WAL_CHECKPOINT_PAGES = 256
#: After a checkpoint the WAL file is cut back to this size (SQLite's default keeps it at its peak).
WAL_LIMIT_BYTES = 1024 * 1024
#: Below this many free bytes on the store's disk, the WAL is truncated before each transition.
SHORT_SPACE_BYTES = 2 * WAL_LIMIT_BYTES
#: Errors of the code's use of SQLite (a closed connection, a bad parameter), not of the file.
_MISUSE = (sqlite3.ProgrammingError, sqlite3.InterfaceError)
#: SQLite's primary result codes this module tells apart (sqlite3.h).
_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26

_SCHEMA = """
CREATE TABLE rollouts (
    id         TEXT PRIMARY KEY,
    slot       TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    to_version TEXT NOT NULL,
    state      TEXT NOT NULL,
    spec       TEXT NOT NULL,          -- JSON: waves, max_failed, soak, on_timeout, figures asked for ...
    supersedes TEXT,
    reason     TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE waves (
    rollout_id TEXT NOT NULL REFERENCES rollouts(id),
    idx        INTEGER NOT NULL,
    state      TEXT NOT NULL,
    figures    TEXT,                   -- JSON: the gate's figures when the wave ended
    reason     TEXT NOT NULL DEFAULT '',
    started_at REAL,
    ended_at   REAL,
    PRIMARY KEY (rollout_id, idx)
);
CREATE TABLE devices (
    rollout_id   TEXT NOT NULL REFERENCES rollouts(id),
    device       TEXT NOT NULL,
    wave         INTEGER NOT NULL,
    from_version TEXT,
    to_version   TEXT NOT NULL,
    job_id       TEXT NOT NULL,
    step         TEXT NOT NULL,
    end_state    TEXT,                 -- gate.DeviceEnd once ENDED (and the latest PENDING state before)
    figures      TEXT,                 -- JSON: the job's shadow/probation figures, error code
    sends        INTEGER NOT NULL DEFAULT 0,  -- how often its desired state was published (SENDING, resends)
    sent_at      REAL,
    ended_at     REAL,
    updated_at   REAL NOT NULL,
    PRIMARY KEY (rollout_id, device)
);
CREATE INDEX devices_by_device ON devices (device, step);
CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL,
    at         REAL NOT NULL,
    what       TEXT NOT NULL,
    detail     TEXT NOT NULL           -- JSON
);
"""


def _primary_code(exc: sqlite3.Error) -> int:
    """SQLite's primary result code of ``exc`` (its extended code's low byte); 0 when it has none."""
    return int(getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


class RolloutStoreError(AgentError):
    """The rollout store cannot be used (unreadable, written by a newer controller) or was misused."""

    code = "rollout_store"


class StoreDamagedError(RolloutStoreError):
    """The store's file is damaged (or was emptied): the controller must not run on it."""

    code = "rollout_store_damaged"

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"rollout store {path} is damaged ({what}); it was left as it is. Stop the controller, "
            f"move {path.name} and its -wal and -shm files aside, and restore them from a backup "
            f"(or start without them: a new, empty store that knows no earlier rollout)"
        )
        self.path = path


class StoreFullError(RolloutStoreError):
    """The store's disk is full: the transition was not stored (nothing of it); try again later."""

    code = "rollout_store_full"

    def __init__(self, path: Path, free_bytes: int | None) -> None:
        free = "?" if free_bytes is None else f"{free_bytes}"
        super().__init__(
            f"rollout store {path}: the disk is full ({free} bytes free); the transition was not stored "
            f"and is retried; free space there (the store wants {SHORT_SPACE_BYTES} bytes free beyond "
            f"its file, docs/fleet.md)"
        )
        self.path = path


class RolloutNotFoundError(RolloutStoreError):
    """No rollout has this id: the broker API answers ``not_found``, the console 404."""

    code = "not_found"


class OverlapError(RolloutStoreError):
    """A new rollout touches devices that a running rollout on the same slot still owns."""

    code = "rollout_overlap"

    def __init__(self, rollout_id: str, slot: str, devices: Sequence[str]) -> None:
        shown = ", ".join(devices[:20]) + (f" and {len(devices) - 20} more" if len(devices) > 20 else "")
        super().__init__(
            f"rollout {rollout_id} still owns slot {slot!r} on {len(devices)} of these devices: {shown}; "
            f"wait for it, abort it, or start this one with supersedes={rollout_id}"
        )
        self.rollout_id = rollout_id
        self.devices = tuple(devices)


class RolloutStore:
    """The controller's rollout state in the SQLite file at ``path`` (created if missing).

    Thread-safe: one connection behind one lock; every public method that changes something is one
    transaction. ``clock`` gives timestamps (seconds since the epoch). The queries and transitions
    are written once, for both stores: :class:`~agent.fleet.rollout.pg_store.PostgresRolloutStore`
    runs them on PostgreSQL and replaces only what is SQLite's own (the file, its pragmas).
    """

    #: What keeps a rollout's devices in their selection order (PostgreSQL has no rowid).
    _DEVICE_ORDER = "rowid"

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._in_memory = str(path) == ":memory:"
        #: Inside a full-disk episode: when it began and how many writes failed (logged when it ends).
        self._full: tuple[float, int] | None = None
        try:
            if not self._in_memory:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    self._create_file(path)
                elif path.stat().st_size == 0:
                    raise StoreDamagedError(
                        path, "0 bytes: a store is created whole, so this one was emptied after it existed"
                    )
            self._db = self._connect(path)
            try:
                if not self._in_memory:
                    self._check_pages()
                    self._truncate_wal_at_open()
                self._migrate()
            except BaseException:
                self._db.close()
                raise
        except OSError as exc:
            raise RolloutStoreError(
                f"rollout store {path}: cannot open ({exc}); check the file and its disk"
            ) from exc
        except sqlite3.Error as exc:
            if _primary_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
                raise StoreDamagedError(path, str(exc)) from exc
            free = None if self._in_memory else self._free_bytes()
            if free == 0:  # SQLite says "disk I/O error" when it cannot make its -shm file
                raise RolloutStoreError(
                    f"rollout store {path}: cannot open: its disk is full (0 bytes free; SQLite: {exc}); "
                    f"free space there and start the controller again"
                ) from exc
            raise RolloutStoreError(
                f"rollout store {path}: cannot open ({exc}); check the file and its disk"
            ) from exc

    def _truncate_wal_at_open(self) -> None:
        """Give back a WAL left large (by a full disk, or an older controller's 1,000-page checkpoints).

        Best effort: on a disk too full for the checkpoint the store still opens and reads; its
        writes fail, one episode, until space is back.
        """
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError as exc:
            if _primary_code(exc) != _SQLITE_FULL:
                raise

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT) below.
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        except BaseException:
            db.close()
            raise
        return db

    def _create_file(self, path: Path) -> None:
        """Build a new store beside ``path`` and link it into place whole (never over another one).

        So a store file is never seen empty or half-made: a 0-byte file at ``path`` is damage.
        """
        fresh = path.with_name(f".{path.name}.{os.getpid()}.new")
        for leftover in (fresh, fresh.with_name(fresh.name + "-wal"), fresh.with_name(fresh.name + "-shm")):
            leftover.unlink(missing_ok=True)
        self._db = self._connect(fresh)
        try:
            self._migrate()
        finally:
            self._db.close()  # the last connection checkpoints the WAL into the file and removes it
        try:
            with open(fresh, "rb+") as f:
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another controller made it first: use that one
                os.link(fresh, path)
        finally:
            fresh.unlink(missing_ok=True)
        fsync_directory(path.parent)

    def _check_pages(self) -> None:
        """``PRAGMA quick_check``: every page of every table and index is read and its structure checked."""
        problems = [" ".join(str(row[0]).split()) for row in self._db.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise StoreDamagedError(self.path, "; ".join(problems))  # one line: the CLI prints one

    def close(self) -> None:
        """Close the connection (committed transitions are already on disk)."""
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise RolloutStoreError(
                f"rollout store {self.path}: schema {version} was written by a newer controller "
                f"(this one reads {SCHEMA_VERSION}); upgrade the controller"
            )
        if version == 0:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # Another controller may have created the tables between the read and BEGIN IMMEDIATE.
                if int(self._db.execute("PRAGMA user_version").fetchone()[0]) == 0:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def _reading(self) -> Iterator[Sql]:
        """The connection, under the lock, for queries; a SQLite error becomes the store's own."""
        with self._lock:
            try:
                yield self._db
            except _MISUSE:
                raise  # a bug here, not the file's trouble
            except sqlite3.Error as exc:
                raise self._error(exc) from exc

    @contextmanager
    def _transaction(self) -> Iterator[Sql]:
        """One transaction: all of it committed, or (an exception, a full disk) none of it."""
        with self._lock:
            self._make_room()
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")  # a full disk fails here too: rolled back below
                except BaseException:
                    if self._db.in_transaction:  # SQLite may have rolled back already (SQLITE_FULL)
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
            except _MISUSE:
                raise
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            # The episode ends once a transition commits with room to spare; one that commits only
            # because the WAL was just truncated is still inside it (and the next truncates it again).
            if self._full is not None and (self._free_bytes() or 0) >= SHORT_SPACE_BYTES:
                began, failed = self._full
                self._full = None
                log.info(
                    "fleet.rollout_store.disk_writable",
                    path=str(self.path),
                    failed_writes=failed,
                    lasted_s=round(time.monotonic() - began, 1),
                )

    def _make_room(self) -> None:
        """Truncate the WAL before a transition while the disk is (nearly) full.

        A checkpoint copies the WAL into the database and cuts the WAL file to 0 bytes: after a
        full disk that is what gives the store back the space its next transition needs.
        """
        if self._in_memory or (self._full is None and (self._free_bytes() or 0) >= SHORT_SPACE_BYTES):
            return
        with contextlib.suppress(sqlite3.Error):  # still full: the transition itself will say so
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _error(self, exc: sqlite3.Error) -> RolloutStoreError:
        """The store's error for a SQLite one; a full disk starts (or continues) an episode."""
        code = _primary_code(exc)
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return StoreDamagedError(self.path, str(exc))
        if code != _SQLITE_FULL:
            return RolloutStoreError(f"rollout store {self.path}: {exc}; check the file and its disk")
        free = self._free_bytes()
        if self._full is None:
            # Once per episode: the controller retries every step, 5 times a second.
            log.warning("fleet.rollout_store.disk_full", path=str(self.path), free_bytes=free, error=str(exc))
            self._full = (time.monotonic(), 1)
        else:
            self._full = (self._full[0], self._full[1] + 1)
        return StoreFullError(self.path, free)

    # -- reading ---------------------------------------------------------------------------------------

    def rollout(self, rollout_id: str) -> RolloutRow:
        """One rollout; :class:`RolloutStoreError` when there is none with this id."""
        with self._reading() as db:
            row = db.execute(
                "SELECT id, slot, job_id, to_version, state, spec, reason, created_at, updated_at "
                "FROM rollouts WHERE id = ?",
                (rollout_id,),
            ).fetchone()
        if row is None:
            raise RolloutNotFoundError(f"no rollout {rollout_id}")
        return RolloutRow(row[0], row[1], row[2], row[3], RolloutState(row[4]), json.loads(row[5]), *row[6:])

    def open_rollouts(self) -> list[str]:
        """Ids of the running and paused rollouts, oldest first (what a restarted controller resumes)."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT id FROM rollouts WHERE state IN (?, ?) ORDER BY created_at, id", OPEN_STATES
            ).fetchall()
        return [str(row[0]) for row in rows]

    def devices(self, rollout_id: str, wave: int | None = None) -> list[DeviceRow]:
        """The rollout's devices (of one wave when ``wave`` is given), in wave and selection order."""
        query = (
            "SELECT device, wave, from_version, to_version, job_id, step, end_state, figures, sends, "
            "sent_at, ended_at FROM devices WHERE rollout_id = ?"
        )
        params: tuple[Any, ...] = (rollout_id,)
        if wave is not None:
            query += " AND wave = ?"
            params = (rollout_id, wave)
        with self._reading() as db:
            rows = db.execute(f"{query} ORDER BY wave, {self._DEVICE_ORDER}", params).fetchall()
        return [
            DeviceRow(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                DeviceStep(r[5]),
                None if r[6] is None else DeviceEnd(r[6]),
                None if r[7] is None else json.loads(r[7]),
                r[8],
                r[9],
                r[10],
            )
            for r in rows
        ]

    def device_counts(self, rollout_id: str) -> list[tuple[int, str, str, int]]:
        """How many of the rollout's devices are at each (wave, step, end or ""), counted by SQLite:
        ``/metrics`` reads it at every scrape, where :meth:`devices` of a large rollout costs far more."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT wave, step, COALESCE(end_state, ''), COUNT(*) FROM devices WHERE rollout_id = ? "
                "GROUP BY wave, step, end_state ORDER BY wave, step, end_state",
                (rollout_id,),
            ).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    def last_change(self, rollout_id: str) -> float | None:
        """When anything of the rollout last moved (Unix seconds): a device's step, end or job state, a
        wave's start or end, the rollout's state; ``/metrics`` exports it (a stalled rollout's stops)."""
        with self._reading() as db:
            row = db.execute(
                "SELECT MAX(t) FROM ("
                "SELECT MAX(updated_at) AS t FROM devices WHERE rollout_id = ? "
                "UNION ALL SELECT MAX(started_at) FROM waves WHERE rollout_id = ? "
                "UNION ALL SELECT MAX(ended_at) FROM waves WHERE rollout_id = ? "
                "UNION ALL SELECT updated_at FROM rollouts WHERE id = ?) AS changes",
                (rollout_id, rollout_id, rollout_id, rollout_id),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def change_mark(self) -> tuple[int, int]:
        """Moves whenever the store's content may have changed, written through this store or another
        connection to its file; a reader that keeps what it read (``/metrics``) reads again then."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            return int(version), self._db.total_changes

    def waves(self, rollout_id: str) -> list[tuple[WaveState, dict[str, Any] | None, str]]:
        """Each wave's state, gate figures and reason, in order."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT state, figures, reason FROM waves WHERE rollout_id = ? ORDER BY idx", (rollout_id,)
            ).fetchall()
        return [(WaveState(r[0]), None if r[1] is None else json.loads(r[1]), r[2]) for r in rows]

    def wave_rows(self, rollout_id: str) -> list[WaveRow]:
        """Each wave with its times (the runner's timeout and soak count from ``started_at``)."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT idx, state, figures, reason, started_at, ended_at FROM waves WHERE rollout_id = ? "
                "ORDER BY idx",
                (rollout_id,),
            ).fetchall()
        return [
            WaveRow(int(r[0]), WaveState(r[1]), None if r[2] is None else json.loads(r[2]), r[3], r[4], r[5])
            for r in rows
        ]

    def rollouts(self, limit: int = 100) -> list[RolloutRow]:
        """The newest ``limit`` rollouts, newest first."""
        with self._reading() as db:
            ids = db.execute(
                "SELECT id FROM rollouts ORDER BY created_at DESC, id DESC LIMIT ?", (limit,)
            ).fetchall()
        return [self.rollout(str(r[0])) for r in ids]

    def events(self, rollout_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The rollout's transitions in the order they were committed."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT what, detail FROM events WHERE rollout_id = ? ORDER BY id", (rollout_id,)
            ).fetchall()
        return [(str(r[0]), json.loads(r[1])) for r in rows]

    def resume(self, rollout_id: str) -> ResumePoint:
        """Where a restarted controller picks ``rollout_id`` up (see the module docstring)."""
        rollout = self.rollout(rollout_id)
        with self._reading() as db:
            current = db.execute(
                "SELECT idx, state FROM waves WHERE rollout_id = ? AND state IN (?, ?) ORDER BY idx LIMIT 1",
                (rollout_id, WaveState.RUNNING.value, WaveState.SOAKING.value),
            ).fetchone()
        if current is None:
            return ResumePoint(rollout_id, rollout.state, None, None, (), (), (), ())
        by_step: dict[DeviceStep, list[str]] = {step: [] for step in DeviceStep}
        for row in self.devices(rollout_id, wave=int(current[0])):
            by_step[row.step].append(row.device)
        return ResumePoint(
            rollout_id,
            rollout.state,
            int(current[0]),
            WaveState(current[1]),
            tuple(by_step[DeviceStep.PLANNED]),
            tuple(by_step[DeviceStep.SENDING]),
            tuple(by_step[DeviceStep.SENT]),
            tuple(by_step[DeviceStep.ENDED]),
        )

    def check(self) -> list[str]:
        """Problems with the file's consistency (``PRAGMA integrity_check`` and the store's invariants)."""
        problems: list[str] = []
        with self._reading() as db:
            problems.extend(self._integrity_problems(db))
            for device, step, sent_at, end in db.execute(
                "SELECT device, step, sent_at, end_state FROM devices"
            ).fetchall():
                if step == DeviceStep.SENT.value and sent_at is None:
                    problems.append(f"{device}: SENT without sent_at")
                if step == DeviceStep.ENDED.value and end in (None, DeviceEnd.PENDING.value):
                    problems.append(f"{device}: ENDED without an end")
        return problems

    def _integrity_problems(self, db: Sql) -> list[str]:
        integrity = [str(r[0]) for r in db.execute("PRAGMA integrity_check").fetchall()]
        return [] if integrity == ["ok"] else integrity

    def recent_ids(self, limit: int) -> list[str]:
        """The newest ``limit`` rollout ids, newest first, read on a read-only connection of its own to
        the file (WAL: it reads while the controller writes, and never waits for the store's lock)."""
        try:
            with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=2.0) as db:
                rows = db.execute(
                    "SELECT id FROM rollouts ORDER BY created_at DESC, id DESC LIMIT ?", (limit,)
                ).fetchall()
        except sqlite3.Error as exc:
            raise RolloutStoreError(f"rollout store {self.path}: cannot list rollouts ({exc})") from exc
        return [str(row[0]) for row in rows]

    def _event(self, db: Sql, rollout_id: str, what: str, **detail: Any) -> None:
        db.execute(
            "INSERT INTO events (rollout_id, at, what, detail) VALUES (?, ?, ?, ?)",
            (rollout_id, self._clock(), what, json.dumps(detail, sort_keys=True)),
        )

    # -- creating ----------------------------------------------------------------------------------

    def create(self, plan: RolloutPlan) -> None:
        """Store a new rollout with its waves and devices (all PLANNED), refusing an overlap.

        Raises :class:`OverlapError` when a running or paused rollout on ``plan.slot`` holds any of
        the devices and is not ``plan.supersedes``; superseding ends that rollout ``SUPERSEDED`` and
        cancels its unsent devices in the same transaction.
        """
        devices = [device for wave in plan.waves for device in wave]
        if len(set(devices)) != len(devices):
            raise RolloutStoreError(f"rollout {plan.rollout_id}: a device appears in two waves")
        now = self._clock()
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM rollouts WHERE id = ?", (plan.rollout_id,)).fetchone():
                raise RolloutStoreError(f"rollout {plan.rollout_id} exists already; pick another id")
            owners = self._owners(db, plan.slot, devices)
            for owner, owned in sorted(owners.items()):
                if owner != plan.supersedes:
                    raise OverlapError(owner, plan.slot, owned)
            if plan.supersedes is not None:
                self._supersede(db, plan.supersedes, plan.rollout_id, now)
            db.execute(
                "INSERT INTO rollouts (id, slot, job_id, to_version, state, spec, supersedes, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    plan.rollout_id,
                    plan.slot,
                    plan.job_id,
                    plan.to_version,
                    RolloutState.RUNNING.value,
                    json.dumps(dict(plan.spec), sort_keys=True),
                    plan.supersedes,
                    now,
                    now,
                ),
            )
            for index, wave in enumerate(plan.waves):
                db.execute(
                    "INSERT INTO waves (rollout_id, idx, state) VALUES (?, ?, ?)",
                    (plan.rollout_id, index, WaveState.WAITING.value),
                )
                db.executemany(
                    "INSERT INTO devices (rollout_id, device, wave, from_version, to_version, job_id, step, "
                    "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            plan.rollout_id,
                            device,
                            index,
                            plan.from_versions.get(device),
                            plan.to_version,
                            plan.job_id,
                            DeviceStep.PLANNED.value,
                            now,
                        )
                        for device in wave
                    ],
                )
            self._event(
                db,
                plan.rollout_id,
                "created",
                devices=len(devices),
                waves=len(plan.waves),
                supersedes=plan.supersedes,
            )

    def _owners(self, db: Sql, slot: str, devices: Sequence[str]) -> dict[str, list[str]]:
        """Open rollouts on ``slot`` that hold any of ``devices``.

        A device whose job already ended still belongs to its open rollout: an abort with rollback
        may yet move it back, which a second rollout would contradict.
        """
        db.execute("CREATE TEMP TABLE IF NOT EXISTS wanted (device TEXT PRIMARY KEY)")
        db.execute("DELETE FROM wanted")
        db.executemany("INSERT OR IGNORE INTO wanted VALUES (?)", [(d,) for d in devices])
        rows = db.execute(
            "SELECT r.id, d.device FROM devices d JOIN rollouts r ON r.id = d.rollout_id "
            "JOIN wanted w ON w.device = d.device "
            "WHERE r.slot = ? AND r.state IN (?, ?) ORDER BY r.id, d.device",
            (slot, *OPEN_STATES),
        ).fetchall()
        owners: dict[str, list[str]] = {}
        for rollout_id, device in rows:
            owners.setdefault(rollout_id, []).append(device)
        return owners

    def _supersede(self, db: Sql, old: str, new: str, now: float) -> None:
        row = db.execute("SELECT state FROM rollouts WHERE id = ?", (old,)).fetchone()
        if row is None:
            raise RolloutStoreError(f"supersedes={old}: no such rollout")
        ROLLOUT_MOVES.check(RolloutState(row[0]), RolloutState.SUPERSEDED, who=f"rollout {old}")
        db.execute(
            "UPDATE rollouts SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
            (RolloutState.SUPERSEDED.value, f"superseded by {new}", now, old),
        )
        self._cancel_unsent(db, old, now, f"superseded by {new}")
        self._event(db, old, "superseded", by=new)

    def _cancel_unsent(self, db: Sql, rollout_id: str, now: float, why: str) -> None:
        db.execute(
            "UPDATE devices SET step = ?, updated_at = ? WHERE rollout_id = ? AND step = ?",
            (DeviceStep.CANCELLED.value, now, rollout_id, DeviceStep.PLANNED.value),
        )
        # The wave's own reason ("soaking 300 s; gate holds") no longer holds: it says why it ended.
        db.execute(
            "UPDATE waves SET state = ?, reason = ?, "
            "ended_at = CASE WHEN started_at IS NULL THEN ended_at ELSE COALESCE(ended_at, ?) END "
            "WHERE rollout_id = ? AND state IN (?, ?, ?)",
            (
                WaveState.CANCELLED.value,
                f"cancelled: {why}",
                now,
                rollout_id,
                WaveState.WAITING.value,
                WaveState.RUNNING.value,
                WaveState.SOAKING.value,
            ),
        )

    # -- transitions -------------------------------------------------------------------------------

    def set_state(self, rollout_id: str, state: RolloutState, reason: str = "") -> None:
        """Pause, resume, finish or abort a rollout; ABORTED cancels its unsent devices as well."""
        now = self._clock()
        with self._transaction() as db:
            old = self._rollout_state(db, rollout_id)
            ROLLOUT_MOVES.check(old, state, who=f"rollout {rollout_id}")
            db.execute(
                "UPDATE rollouts SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
                (state.value, reason, now, rollout_id),
            )
            if state is RolloutState.ABORTED:
                self._cancel_unsent(db, rollout_id, now, reason or "the rollout was aborted")
            self._event(db, rollout_id, "rollout", state=state.value, reason=reason)

    def set_wave(
        self,
        rollout_id: str,
        index: int,
        state: WaveState,
        *,
        figures: Mapping[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        """Move wave ``index`` to ``state`` (RUNNING stamps its start, DONE/TRIPPED its end and figures)."""
        now = self._clock()
        with self._transaction() as db:
            row = db.execute(
                "SELECT state FROM waves WHERE rollout_id = ? AND idx = ?", (rollout_id, index)
            ).fetchone()
            if row is None:
                raise RolloutStoreError(f"rollout {rollout_id} has no wave {index}")
            WAVE_MOVES.check(WaveState(row[0]), state, who=f"rollout {rollout_id} wave {index}")
            started = now if state is WaveState.RUNNING else None
            ended = now if WAVE_MOVES[state] == frozenset() else None
            db.execute(
                "UPDATE waves SET state = ?, figures = COALESCE(?, figures), reason = ?, "
                "started_at = COALESCE(started_at, ?), ended_at = COALESCE(ended_at, ?) "
                "WHERE rollout_id = ? AND idx = ?",
                (
                    state.value,
                    None if figures is None else json.dumps(dict(figures), sort_keys=True),
                    reason,
                    started,
                    ended,
                    rollout_id,
                    index,
                ),
            )
            self._event(db, rollout_id, "wave", wave=index, state=state.value, reason=reason)

    def mark_sending(self, rollout_id: str, device: str) -> str:
        """Record that ``device``'s desired state is about to be published; returns its job id.

        Written *before* the publish, so a crash between the two leaves the device SENDING and a
        restart publishes the same desired state again rather than skipping the device.
        """
        return self._move(rollout_id, device, DeviceStep.SENDING)

    def mark_sent(self, rollout_id: str, device: str) -> str:
        """Record that the broker acknowledged ``device``'s desired state; returns its job id."""
        return self._move(rollout_id, device, DeviceStep.SENT)

    def mark_resent(self, rollout_id: str, devices: Iterable[str], why: str) -> None:
        """Count one more publish of the (same) desired state of each of ``devices``, in one transaction.

        For a publish that does not move the device (SENDING counts itself): a restarted controller
        publishing its SENT devices again, a deploy publishing its wave again after the broker came
        back. ``sends`` > 1 is what ``sends.resent`` of the rollout's status counts.
        """
        names = list(devices)
        if not names:
            return
        now = self._clock()
        with self._transaction() as db:
            db.executemany(
                "UPDATE devices SET sends = sends + 1, updated_at = ? WHERE rollout_id = ? AND device = ?",
                [(now, rollout_id, device) for device in names],
            )
            self._event(db, rollout_id, "resent", devices=len(names), why=why)

    def record_job(
        self, rollout_id: str, device: str, end: DeviceEnd, figures: Mapping[str, Any] | None = None
    ) -> None:
        """Store a job status of ``device``: its figures, and, when ``end`` is final, its end (ENDED).

        ``figures`` are merged over the stored ones, key by key: a status that lacks a figure an
        earlier status of the job carried (its shadow figures, say) does not erase it.
        """
        now = self._clock()
        with self._transaction() as db:
            step = self._device_step(db, rollout_id, device)
            final = end is not DeviceEnd.PENDING
            if final:
                DEVICE_MOVES.check(step, DeviceStep.ENDED, who=f"rollout {rollout_id} device {device}")
            elif step in (DeviceStep.ENDED, DeviceStep.CANCELLED):
                return  # a late, out-of-order status of a device that ended: its end stands
            merged = None
            if figures is not None:
                row = db.execute(
                    "SELECT figures FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
                ).fetchone()
                merged = {**(json.loads(row[0]) if row and row[0] else {}), **figures}
            db.execute(
                "UPDATE devices SET step = ?, end_state = ?, figures = COALESCE(?, figures), "
                "ended_at = ?, updated_at = ? WHERE rollout_id = ? AND device = ?",
                (
                    DeviceStep.ENDED.value if final else step.value,
                    end.value,
                    None if merged is None else json.dumps(merged, sort_keys=True),
                    now if final else None,
                    now,
                    rollout_id,
                    device,
                ),
            )
            if final:
                self._event(db, rollout_id, "device", device=device, end=end.value)

    def _move(self, rollout_id: str, device: str, step: DeviceStep) -> str:
        now = self._clock()
        with self._transaction() as db:
            old = self._device_step(db, rollout_id, device)
            DEVICE_MOVES.check(old, step, who=f"rollout {rollout_id} device {device}")
            db.execute(
                "UPDATE devices SET step = ?, sends = sends + ?, sent_at = COALESCE(?, sent_at), "
                "updated_at = ? WHERE rollout_id = ? AND device = ?",
                (
                    step.value,
                    1 if step is DeviceStep.SENDING else 0,
                    now if step is DeviceStep.SENT else None,
                    now,
                    rollout_id,
                    device,
                ),
            )
            self._event(db, rollout_id, "device", device=device, step=step.value)
            row = db.execute(
                "SELECT job_id FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
            ).fetchone()
            return str(row[0])

    def _rollout_state(self, db: Sql, rollout_id: str) -> RolloutState:
        row = db.execute("SELECT state FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise RolloutNotFoundError(f"no rollout {rollout_id}")
        return RolloutState(row[0])

    def _device_step(self, db: Sql, rollout_id: str, device: str) -> DeviceStep:
        row = db.execute(
            "SELECT step FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
        ).fetchone()
        if row is None:
            raise RolloutStoreError(f"rollout {rollout_id} has no device {device}")
        return DeviceStep(row[0])

    def note(self, rollout_id: str, what: str, **detail: Any) -> None:
        """Log an event that is no state transition (a rollback planned, an operator's wish)."""
        with self._transaction() as db:
            self._rollout_state(db, rollout_id)
            self._event(db, rollout_id, what, **detail)
