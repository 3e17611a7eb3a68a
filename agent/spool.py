"""SQLite outbox for MQTT messages that must not be lost (job status, durable results).

A message is written (and fsynced: WAL + ``synchronous=FULL``) before it is sent, and deleted only
when the broker acknowledged it, so a broker outage, a crash or a power cut loses nothing; the
price is a possible duplicate, which consumers drop by ``msg_id``. A small key/value table keeps
the link's state that must survive restarts (the session counter).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.errors import TransportError

log = structlog.get_logger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    topic   TEXT    NOT NULL,
    payload BLOB    NOT NULL,
    qos     INTEGER NOT NULL,
    retain  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class SpooledMessage:
    """One message waiting in the outbox."""

    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool


class Spool:
    """The outbox at ``path`` (created if missing). Thread-safe: one connection behind one lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            # isolation_level=None: autocommit; every statement is its own durable transaction.
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise TransportError(
                f"cannot open the message spool {path}: {exc}; check that the state directory is "
                "writable and the disk is not full (delete the file only if losing queued messages is "
                "acceptable)"
            ) from exc
        self._closed = False

    def add(self, topic: str, payload: bytes, qos: int, retain: bool) -> int:
        """Store a message durably; return its id (ids strictly increase, also across restarts)."""
        with self._lock:
            try:
                # AUTOINCREMENT: ids are never reused, even after the newest row was deleted.
                cur = self._db.execute(
                    "INSERT INTO outbox (topic, payload, qos, retain) VALUES (?, ?, ?, ?)",
                    (topic, sqlite3.Binary(payload), qos, int(retain)),
                )
            except sqlite3.Error as exc:
                raise TransportError(
                    f"cannot store a message for {topic} in the spool {self.path}: {exc}; "
                    "check free disk space in the state directory"
                ) from exc
            row_id = cur.lastrowid
        assert row_id is not None
        return row_id

    def pending(self, limit: int = 100, after_id: int = 0) -> list[SpooledMessage]:
        """Up to ``limit`` messages with id > ``after_id``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, topic, payload, qos, retain FROM outbox WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
        return [SpooledMessage(r[0], r[1], bytes(r[2]), r[3], bool(r[4])) for r in rows]

    def remove(self, message_id: int) -> None:
        """Forget a message (it was acknowledged, or refused for good). Unknown ids are ignored."""
        with self._lock:
            self._db.execute("DELETE FROM outbox WHERE id = ?", (message_id,))

    def count(self) -> int:
        """Number of messages waiting."""
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
        return int(n)

    def get_meta(self, key: str) -> str | None:
        """A value of the key/value table, or None."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        """Set (durably) a value of the key/value table."""
        with self._lock:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
