"""The enrollment book on PostgreSQL: the SQLite book's records, queries and transactions, in the
controller's database, so a controller that took the lease over on another host, with another
``state_dir``, knows who is registered, pending, rejected and enrolled (with the certificate a
repeated request gets again) and how often each claim was used.

:class:`PostgresEnrollmentBook` inherits every query of
:class:`~agent.fleet.enrollment.book.EnrollmentBook` and replaces only where they run. Every change
is one transaction, committed before the desk sends the reply that depends on it; with a
:attr:`fence`, the transaction first checks the lease's token, as every write of a controller on
PostgreSQL does, so a holder whose lease was taken changes nothing
(:class:`~agent.fleet.statedb.postgres.FencedError`: the desk answers nothing, the device asks
again and the new holder answers). A claim's use is counted and checked against
its limit by one upsert, which PostgreSQL serialises on the claim's row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent.fleet.enrollment.book import BookError, EnrollmentBook
from agent.fleet.statedb.postgres import DatabaseError, Fence, StateDatabase
from agent.fleet.statedb.sql import Sql


def open_enrollment_book(
    path: Path, database: StateDatabase | None, *, fence: Fence | None = None
) -> EnrollmentBook:
    """The desk's records: in ``database`` when the controller's store is PostgreSQL, else the
    SQLite file at ``path``."""
    if database is None:
        return EnrollmentBook(path)
    return PostgresEnrollmentBook(database, fence=fence)


class PostgresEnrollmentBook(EnrollmentBook):
    """The records in the PostgreSQL ``database`` (migrated at open). Thread-safe."""

    def __init__(self, database: StateDatabase, *, fence: Fence | None = None) -> None:
        self.database = database
        #: Where the records are, in messages only (the database's host, port and name).
        self.path = Path(database.where)
        #: The lease token every change checks (None: unguarded, as a reader's).
        self.fence = fence
        try:
            database.migrate()
        except DatabaseError as exc:
            database.close()
            raise BookError(f"enrollment records: {exc}") from exc

    def close(self) -> None:
        self.database.close()

    @contextmanager
    def _writing(self) -> Iterator[Sql]:
        # The database's own lock makes the desk's thread and the operator's requests take turns.
        with self.database.transaction(self.fence) as sql:
            yield sql

    def _rows(self, sql: str, *args: object) -> list[Any]:
        with self.database.session() as db:
            return list(db.execute(sql, args).fetchall())
