"""The spool's SQLite file: its tables, the columns later releases added, and how it is opened
(WAL, ``synchronous=FULL``, a bounded write-ahead log).

One job (the file's shape and its upgrade on open); the queries on it are :mod:`agent.spool.queue`'s.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

#: Cap on the write-ahead log after a checkpoint (SQLite otherwise keeps its largest size forever).
_WAL_LIMIT_BYTES = 64 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    topic      TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    qos        INTEGER NOT NULL,
    retain     INTEGER NOT NULL,
    kind       INTEGER NOT NULL DEFAULT 0,
    expires_at REAL
);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""
#: Columns added after the first release: a spool written by an older agent gets them on open
#: (its rows become job states: never dropped, never expired, which is what they were promised).
_ADDED_COLUMNS = (
    ("kind", "ALTER TABLE outbox ADD COLUMN kind INTEGER NOT NULL DEFAULT 0"),
    ("expires_at", "ALTER TABLE outbox ADD COLUMN expires_at REAL"),
)


def open_outbox(path: Path) -> sqlite3.Connection:
    """Open (or create) the spool at ``path``, its tables up to date; sqlite3.Error when it cannot.

    Autocommit (``isolation_level=None``): every statement, or BEGIN..COMMIT, is its own durable
    transaction. One connection for all threads: the spool serialises them behind its lock.
    """
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT_BYTES}")
    db.executescript(_SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_info(outbox)")}
    for name, ddl in _ADDED_COLUMNS:
        if name not in columns:
            db.execute(ddl)
    return db
