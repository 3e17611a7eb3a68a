"""What the stores' queries run on, whichever the database: a sqlite3 connection or PostgreSQL's
(:class:`~agent.fleet.statedb.postgres.PgSql`). No driver here: the SQLite store imports this
module, and a controller on SQLite needs no PostgreSQL driver installed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Rows(Protocol):
    """What a query returns (sqlite3's and psycopg's cursors both are)."""

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    @property
    def rowcount(self) -> int: ...


class Sql(Protocol):
    """A connection the stores' SQL (``?`` placeholders) runs on."""

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Rows: ...

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> Any: ...
