"""Where a test's controller store lives: a SQLite file or a database on the tests' real PostgreSQL
(tests/postgres_server.py). The store tests run once on each (the ``store_site`` fixture in
tests/fleet/conftest.py); a child process opens the same store from its address
(:func:`open_store`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.fleet.rollout.pg_store import PostgresRolloutStore
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.statedb.postgres import StateDatabase


def open_store(address: str) -> RolloutStore:
    """The store at ``address``: a libpq URL (postgresql://...) or a SQLite file's path."""
    if address.startswith("postgresql://"):
        return PostgresRolloutStore(StateDatabase(address))
    return RolloutStore(Path(address))


@dataclass(frozen=True)
class StoreSite:
    """One store's place: ``kind`` is ``sqlite`` or ``postgresql``; :meth:`open` opens it (again)."""

    kind: str
    address: str

    def open(self) -> RolloutStore:
        return open_store(self.address)
