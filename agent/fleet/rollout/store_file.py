"""The rollout store's SQLite file: its schema and migrations, opening and creating it, one
transaction at a time, and SQLite's errors in the operator's words.

Every transition is one SQLite transaction, in WAL mode with ``synchronous=FULL``: a ``kill -9`` or a
power cut leaves the store at a transition boundary (:mod:`agent.fleet.rollout.store` says which
transitions there are). The schema is versioned (``PRAGMA user_version``); a store written by a newer
controller is refused.

A damaged file is never used: opening runs ``PRAGMA quick_check``, and any SQLite error that says the
file is damaged, at open or later, is a :class:`StoreDamagedError` naming the file and what to do. A
new store is built beside its path and linked into place whole, so a 0-byte file at the path was
emptied by something else (a failed restore, a disk fault) and is refused, not taken for a new store.
A full disk fails one transition (:class:`StoreFullError`, nothing half-written) and is logged once
per episode; the WAL is kept small (checkpointed every :data:`WAL_CHECKPOINT_PAGES` pages, truncated
to :data:`WAL_LIMIT_BYTES`) and truncated whenever free space is short or a write failed, so the space
freed after a full disk is enough for the next transition (docs/fleet.md "Failure modes").
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import structlog

from agent.errors import AgentError
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


class StoreFile:
    """The SQLite file at ``path`` (created if missing), behind one connection and one lock.

    :class:`~agent.fleet.rollout.store.RolloutStore` is this file with the rollout's queries and
    transitions; each of them runs inside :meth:`_reading` or :meth:`_transaction`. ``clock`` gives
    timestamps (seconds since the epoch).
    """

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
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock, for queries; a SQLite error becomes the store's own."""
        with self._lock:
            try:
                yield self._db
            except _MISUSE:
                raise  # a bug here, not the file's trouble
            except sqlite3.Error as exc:
                raise self._error(exc) from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
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
