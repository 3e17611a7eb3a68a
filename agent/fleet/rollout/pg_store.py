"""The rollout store on PostgreSQL: the same tables, queries and transitions as the SQLite store.

:class:`PostgresRolloutStore` inherits every query and transition of
:class:`~agent.fleet.rollout.store.RolloutStore` and replaces what is SQLite's own: the file and its
pragmas, the temporary table of an overlap check, the change mark ``/metrics`` reads. Every
transition is one PostgreSQL transaction with its row in ``events``, as on SQLite, so a controller
killed at any point leaves the store at a transition boundary.

With a :attr:`fence` (the controller's lease in the database, controller/db_lease.py), every
transition first checks, in its own transaction, that the lease's token is still this controller's:
a controller that was frozen past its lease and woke up after a standby took over writes nothing
(:class:`~agent.fleet.statedb.postgres.FencedError`, counted in :attr:`fenced_writes`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import structlog

from agent.fleet.rollout.records import OPEN_STATES
from agent.fleet.rollout.store import RolloutStore, RolloutStoreError
from agent.fleet.statedb.postgres import DatabaseError, Fence, FencedError, StateDatabase
from agent.fleet.statedb.sql import Sql

log = structlog.get_logger(__name__)


class PostgresRolloutStore(RolloutStore):
    """The rollout state in the PostgreSQL ``database`` (migrated at open). Thread-safe."""

    _DEVICE_ORDER = "pos"

    def __init__(
        self, database: StateDatabase, *, fence: Fence | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.database = database
        #: Where the store is, in messages only (the database's host, port and name).
        self.path = Path(database.where)
        self.fence = fence
        #: Transitions refused because another controller took the lease.
        self.fenced_writes = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._in_memory = False
        self._full = None
        try:
            database.migrate()
        except DatabaseError as exc:
            database.close()
            raise RolloutStoreError(f"rollout store {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self.database.close()

    @contextmanager
    def _reading(self) -> Iterator[Sql]:
        with self._lock, self.database.session() as sql:
            yield sql

    @contextmanager
    def _transaction(self) -> Iterator[Sql]:
        with self._lock:
            try:
                with self.database.transaction(self.fence) as sql:
                    yield sql
            except FencedError as exc:
                self.fenced_writes += 1
                log.error("fleet.rollout_store.fenced", refused=self.fenced_writes, error=str(exc))
                raise

    def change_mark(self) -> tuple[int, int]:
        """Moves whenever a transaction that wrote anything committed in this database (the
        server's next transaction id): reading again after another's write is right, only slower."""
        with self._reading() as sql:
            row = sql.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
        return int(row[0]), 0

    def _owners(self, db: Sql, slot: str, devices: Sequence[str]) -> dict[str, list[str]]:
        rows = db.execute(
            "SELECT r.id, d.device FROM devices d JOIN rollouts r ON r.id = d.rollout_id "
            "WHERE d.device = ANY(?) AND r.slot = ? AND r.state IN (?, ?) ORDER BY r.id, d.device",
            (list(devices), slot, *OPEN_STATES),
        ).fetchall()
        owners: dict[str, list[str]] = {}
        for rollout_id, device in rows:
            owners.setdefault(rollout_id, []).append(device)
        return owners

    def _integrity_problems(self, db: Sql) -> list[str]:
        return []  # PostgreSQL checks its own pages (data checksums); the invariants are checked above

    def recent_ids(self, limit: int) -> list[str]:
        with self._reading() as sql:
            rows = sql.execute(
                "SELECT id FROM rollouts ORDER BY created_at DESC, id DESC LIMIT ?", (limit,)
            ).fetchall()
        return [str(row[0]) for row in rows]
