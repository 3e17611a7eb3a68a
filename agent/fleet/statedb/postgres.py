"""The controller's PostgreSQL connection: connect with the password from its file, migrate, and run
transactions that a fencing token guards.

One connection per user (the rollout store, the lease, the model repository), each behind a lock of
its own; psycopg 3 in autocommit mode, so a transaction is always explicit and whole. A connection
that breaks (the database restarted, the network cut) is dropped and made again at the next use; the
transaction it carried is rolled back by the server, and the caller gets
:class:`DatabaseUnavailableError`: nothing of it was kept, or (the link died during ``COMMIT``) the
caller cannot know, which is why the controller rebuilds its rollouts from the store after an outage.

A write guarded by a :class:`Fence` first locks the prefix's lease row ``FOR SHARE`` and checks that
its token is still the fence's; a standby that takes the lease bumps the token with an ``UPDATE`` of
that row, which waits for every guarded transaction holding it, so a write either commits before the
takeover or sees the new token and is refused (:class:`FencedError`), never after it. A holder frozen
inside such a transaction (SIGSTOP, a hung host) would hold that lock for ever, its connection kept
alive by its kernel; the server ends every session of ours that sits idle inside a transaction for
:data:`IDLE_IN_TRANSACTION_S`, which bounds how long a takeover can wait for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agent.errors import AgentError
from agent.fleet.statedb.migrations import LATEST, MIGRATIONS
from agent.fleet.statedb.settings import DatabaseSettings
from agent.fleet.statedb.sql import Rows
from agent.secret_file import read_secret

log = structlog.get_logger(__name__)

#: A link that carries nothing for this long is dead (libpq's tcp_user_timeout, keepalives): a write
#: on a cut network fails in seconds instead of the kernel's retransmission minutes.
DEAD_LINK_S = 5
#: A session idle inside a transaction this long is ended by the server (its locks released): ours
#: run their statements back to back, so only a frozen or hung holder sits there.
IDLE_IN_TRANSACTION_S = 10
#: Held while migrating: two controllers starting at once apply each migration once.
_MIGRATION_LOCK = 0x6564676546_1EE7


class DatabaseError(AgentError):
    """The database refused something or cannot be used (the message says what and what to do)."""

    code = "state_db"


class DatabaseUnavailableError(DatabaseError):
    """The database cannot be reached now; the transaction was not kept (retried after reconnecting)."""

    code = "state_db_unavailable"


class FencedError(DatabaseError):
    """This controller's lease token is no longer the prefix's: another controller holds it now."""

    code = "lease_fenced"


@dataclass(frozen=True)
class Fence:
    """The lease a write must still hold: the prefix's lease row with this token."""

    prefix: str
    token: int


class PgSql:
    """A psycopg connection that takes the stores' SQL as written for SQLite (``?`` placeholders)."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Rows:
        return self.connection.execute(_placeholders(sql), tuple(parameters))

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> None:
        with self.connection.cursor() as cursor:
            cursor.executemany(_placeholders(sql), list(seq_of_parameters))


def _placeholders(sql: str) -> str:
    # The stores' SQL has no literal "?" or "%": every "?" is a parameter.
    return sql.replace("?", "%s")


def conninfo_of(settings: DatabaseSettings) -> str:
    """The libpq connection string of ``settings``, its password read from ``password_file``."""
    if settings.url is None:
        raise DatabaseError("database.url is not set")
    password = None if settings.password_file is None else read_secret(settings.password_file)
    extra = {} if password is None else {"password": password}
    return make_conninfo(settings.url, connect_timeout=settings.connect_timeout_s, **extra)


def shown(conninfo: str) -> str:
    """The database as logs and errors name it: host, port and database, never the password."""
    try:
        parts = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "the database"
    host, port = parts.get("host", "localhost"), parts.get("port", 5432)
    return f"postgresql://{host}:{port}/{parts.get('dbname', '')}"


class StateDatabase:
    """One connection to the controller's database, made again after it broke (see the module docstring)."""

    def __init__(self, conninfo: str, *, name: str = "controller") -> None:
        self.conninfo = make_conninfo(
            conninfo,
            application_name=f"edge-fleet-{name}",
            keepalives=1,
            keepalives_idle=DEAD_LINK_S,
            keepalives_interval=1,
            keepalives_count=DEAD_LINK_S,
            tcp_user_timeout=DEAD_LINK_S * 1000,
        )
        if "connect_timeout" not in conninfo_to_dict(self.conninfo):
            self.conninfo = make_conninfo(self.conninfo, connect_timeout=DEAD_LINK_S)
        self.where = shown(self.conninfo)
        self._lock = threading.RLock()
        self._connection: psycopg.Connection[Any] | None = None

    def _live(self) -> psycopg.Connection[Any]:
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            self._connection = None
            connection = psycopg.connect(self.conninfo, autocommit=True)
            connection.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                (str(IDLE_IN_TRANSACTION_S * 1000),),
            )
            self._connection = connection
        return connection

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                connection.close()

    @contextmanager
    def session(self) -> Iterator[PgSql]:
        """The connection (each statement its own transaction), under this database's lock."""
        with self._lock, self._errors():
            yield PgSql(self._live())

    @contextmanager
    def transaction(self, fence: Fence | None = None) -> Iterator[PgSql]:
        """One transaction, all of it committed or none; refused (:class:`FencedError`) when
        ``fence`` is given and its token is no longer the prefix's lease."""
        with self._lock, self._errors():
            connection = self._live()
            with connection.transaction():
                sql = PgSql(connection)
                if fence is not None:
                    check_fence(sql, fence)
                yield sql

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except psycopg.OperationalError as exc:
            # A broken link or a server going down: drop the connection, the next use makes another.
            connection, self._connection = self._connection, None
            if connection is not None:
                connection.close()
            raise DatabaseUnavailableError(
                f"{self.where} cannot be reached ({_first_line(exc)}); nothing of this transaction was "
                "kept, it is tried again once the database is back"
            ) from exc
        except psycopg.Error as exc:
            raise DatabaseError(f"{self.where}: {_first_line(exc)}") from exc

    def migrate(self) -> int:
        """Apply the migrations this database lacks, in order; returns its version. DatabaseError
        when a newer controller migrated it past the versions this one knows."""
        with self.transaction() as sql:
            sql.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            sql.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
            )
            done = {int(r[0]) for r in sql.execute("SELECT version FROM schema_migrations").fetchall()}
            if done and max(done) > LATEST:
                raise DatabaseError(
                    f"{self.where}: schema {max(done)} was written by a newer controller (this one reads "
                    f"{LATEST}); upgrade the controller"
                )
            for version, statements in MIGRATIONS:
                if version not in done:
                    sql.connection.execute(statements.encode())
                    sql.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
                    log.info("fleet.statedb.migrated", database=self.where, version=version)
        return LATEST


def check_fence(sql: PgSql, fence: Fence) -> None:
    """FencedError unless the prefix's lease row still carries ``fence.token`` (locked until commit)."""
    row = sql.execute(
        "SELECT token, holder FROM controller_lease WHERE prefix = ? FOR SHARE", (fence.prefix,)
    ).fetchone()
    if row is None or int(row[0]) != fence.token:
        holder = "nobody" if row is None else f"{row[1]} (token {row[0]})"
        raise FencedError(
            f"this controller's lease on prefix {fence.prefix} (token {fence.token}) was taken: it is held "
            f"by {holder}; the write was refused and this controller steps down"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
