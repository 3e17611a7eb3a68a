"""The enrollment desk's records, ``{state_dir}/enrollment.sqlite``: who is registered in advance, who
waits for an operator, who was rejected, who is enrolled (key fingerprint, certificate serial and
expiry, the certificate itself so a repeated request gets the same one), and each claim's uses.

SQLite with ``synchronous=FULL``: every change is one transaction, on disk before the reply that
depends on it is sent, so a restarted controller (``kill -9`` included) neither forgets a pending
device nor issues a second certificate for a request it already answered. One lock: the desk's
thread and the operator's requests take turns. The queries are written for SQLite and PostgreSQL
alike: a controller whose store is PostgreSQL keeps the same records there (pg_book.py).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.fleet.statedb.sql import Sql

#: The schema's version (``PRAGMA user_version``); a newer file is refused.
SCHEMA_VERSION = 1
#: The limit of a claim's uses when the caller gives none (more than any fleet enrolls).
_UNLIMITED = 2**62

_SCHEMA = """
CREATE TABLE registered (kind TEXT NOT NULL, value TEXT NOT NULL, serial TEXT, source TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (kind, value));
CREATE TABLE pending (device_id TEXT PRIMARY KEY, claim TEXT NOT NULL, serial TEXT,
    fingerprint TEXT NOT NULL, csr_pem TEXT NOT NULL, request_id TEXT NOT NULL, code TEXT NOT NULL,
    first_at REAL NOT NULL, last_at REAL NOT NULL, asks INTEGER NOT NULL, contested INTEGER NOT NULL,
    client TEXT NOT NULL);
CREATE INDEX pending_claim ON pending (claim);
CREATE TABLE rejected (device_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE enrolled (device_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, serial TEXT NOT NULL,
    not_after REAL NOT NULL, issued_at REAL NOT NULL, claim TEXT, hw_serial TEXT,
    request_id TEXT NOT NULL, cert_pem TEXT NOT NULL, chain_pem TEXT NOT NULL);
CREATE TABLE claim_uses (claim TEXT PRIMARY KEY, uses INTEGER NOT NULL);
"""


class BookError(AgentError):
    """The enrollment file cannot be used (written by a newer controller)."""

    code = "enrollment_store"


class ClaimUsedUpError(BookError):
    """The claim enrolled as many devices as it may (counted in the same transaction as the spend)."""

    code = "claim_used_up"


@dataclass(frozen=True)
class Pending:
    """A device waiting for an operator: what it asked with, and how often."""

    device_id: str
    claim: str
    serial: str | None
    fingerprint: str
    csr_pem: str
    request_id: str
    code: str  # why it waits: "pending" (unknown) or "already_enrolled" (a re-enrollment)
    first_at: float
    last_at: float
    asks: int
    contested: int  # requests for this id with another key, refused while it waits
    client: str  # the client id it enrolls with: its reply topic's level

    def as_dict(self) -> dict[str, object]:
        return {
            "device_id": self.device_id,
            "claim": self.claim,
            "serial": self.serial,
            "fingerprint": self.fingerprint,
            "reenroll": self.code in ("already_enrolled", "revoked"),
            "code": self.code,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "asks": self.asks,
            "contested": self.contested,
        }


@dataclass(frozen=True)
class Enrolled:
    """A device holding a certificate this desk issued."""

    device_id: str
    fingerprint: str
    serial: str
    not_after: float
    issued_at: float
    claim: str | None
    hw_serial: str | None
    request_id: str
    cert_pem: str
    chain_pem: str

    def as_dict(self) -> dict[str, object]:
        return {
            "device_id": self.device_id,
            "serial": self.serial,
            "not_after": self.not_after,
            "issued_at": self.issued_at,
            "claim": self.claim,
            "hw_serial": self.hw_serial,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class Registration:
    """A device admitted at once: by id (with the serial it must name, if any) or by serial alone."""

    device_id: str | None
    serial: str | None
    source: str  # "cli" or "file"


class EnrollmentBook:
    """The records above, in one SQLite file (created on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            self._db.close()
            raise BookError(f"{path} was written by a newer controller (schema {version}); upgrade this one")
        if version == 0:
            with self._writing() as db:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _writing(self) -> Iterator[Sql]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, *args: object) -> list[Any]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    # -- registrations ------------------------------------------------------------------------------

    def register(self, device_id: str | None, serial: str | None, source: str = "cli") -> None:
        """Admit ``device_id`` (naming ``serial``, if given) or any id naming ``serial`` at once;
        a rejection of that id is lifted."""
        kind, value = ("id", device_id) if device_id is not None else ("serial", serial)
        with self._writing() as db:
            db.execute(
                "INSERT INTO registered VALUES (?, ?, ?, ?, ?) ON CONFLICT (kind, value) DO UPDATE "
                "SET serial = excluded.serial, source = excluded.source, at = excluded.at",
                (kind, value, serial if kind == "id" else None, source, time.time()),
            )
            if device_id is not None:
                db.execute("DELETE FROM rejected WHERE device_id = ?", (device_id,))

    def forget_registrations(self, source: str) -> None:
        """Drop the registrations of ``source`` (the file's, read again at each start)."""
        with self._writing() as db:
            db.execute("DELETE FROM registered WHERE source = ?", (source,))

    def registration_of_id(self, device_id: str) -> Registration | None:
        rows = self._rows("SELECT serial, source FROM registered WHERE kind = 'id' AND value = ?", device_id)
        return None if not rows else Registration(device_id, _text(rows[0][0]), str(rows[0][1]))

    def registration_of_serial(self, serial: str) -> Registration | None:
        rows = self._rows("SELECT source FROM registered WHERE kind = 'serial' AND value = ?", serial)
        return None if not rows else Registration(None, serial, str(rows[0][0]))

    def registrations(self) -> list[Registration]:
        rows = self._rows("SELECT kind, value, serial, source FROM registered ORDER BY kind, value")
        return [
            Registration(str(v), _text(s), str(src)) if k == "id" else Registration(None, str(v), str(src))
            for k, v, s, src in rows
        ]

    # -- pending ------------------------------------------------------------------------------------

    def pending(self, device_id: str) -> Pending | None:
        rows = self._rows("SELECT * FROM pending WHERE device_id = ?", device_id)
        return None if not rows else _pending(rows[0])

    def pending_list(self, limit: int = 10_000) -> list[Pending]:
        return [_pending(r) for r in self._rows("SELECT * FROM pending ORDER BY first_at LIMIT ?", limit)]

    def pending_counts(self, claim: str) -> tuple[int, int]:
        """(pending in all, pending made with ``claim``)."""
        rows = self._rows(
            "SELECT COUNT(*), COALESCE(SUM(CASE WHEN claim = ? THEN 1 ELSE 0 END), 0) FROM pending", claim
        )
        return int(rows[0][0]), int(rows[0][1])

    def add_pending(self, p: Pending) -> None:
        with self._writing() as db:
            db.execute(
                "INSERT INTO pending VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    p.device_id, p.claim, p.serial, p.fingerprint, p.csr_pem, p.request_id, p.code,
                    p.first_at, p.last_at, p.asks, p.contested, p.client,
                ),
            )  # fmt: skip

    def touch_pending(self, device_id: str, *, contested: bool, at: float) -> None:
        """Count one more request for a waiting id (``contested``: with another key)."""
        column = "contested" if contested else "asks"
        with self._writing() as db:
            db.execute(
                f"UPDATE pending SET {column} = {column} + 1, last_at = ? WHERE device_id = ?",  # noqa: S608
                (at, device_id),
            )

    def forget_pending_before(self, at: float) -> int:
        """Drop the waiting devices not heard since ``at`` (they gave up); how many."""
        with self._writing() as db:
            return int(db.execute("DELETE FROM pending WHERE last_at < ?", (at,)).rowcount)

    def reject(self, device_id: str, reason: str) -> bool:
        """Reject ``device_id``: it leaves the pending list; whether it was pending."""
        with self._writing() as db:
            gone = db.execute("DELETE FROM pending WHERE device_id = ?", (device_id,)).rowcount
            db.execute(
                "INSERT INTO rejected VALUES (?, ?, ?) ON CONFLICT (device_id) DO UPDATE "
                "SET reason = excluded.reason, at = excluded.at",
                (device_id, reason, time.time()),
            )
        return bool(gone)

    def rejected(self, device_id: str) -> str | None:
        """Why ``device_id`` was rejected (None: it was not)."""
        rows = self._rows("SELECT reason FROM rejected WHERE device_id = ?", device_id)
        return None if not rows else str(rows[0][0])

    def pending_total(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM pending")[0][0])

    # -- enrolled -----------------------------------------------------------------------------------

    def enrolled(self, device_id: str) -> Enrolled | None:
        rows = self._rows("SELECT * FROM enrolled WHERE device_id = ?", device_id)
        return None if not rows else _enrolled(rows[0])

    def enrolled_list(self) -> list[Enrolled]:
        return [_enrolled(r) for r in self._rows("SELECT * FROM enrolled ORDER BY device_id")]

    def enrolled_total(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM enrolled")[0][0])

    def enroll(self, e: Enrolled, *, spends_claim: bool, claim_limit: int | None = None) -> None:
        """Record ``e`` (replacing an earlier certificate of that device); the device leaves the
        pending list, and one use of its claim is counted when ``spends_claim``. With
        ``claim_limit``, ClaimUsedUpError (nothing recorded) when the claim has that many uses
        already: checked where it is counted, so two controllers on one database never pass it."""
        with self._writing() as db:
            if spends_claim and e.claim is not None:
                limit = _UNLIMITED if claim_limit is None else claim_limit
                spent = db.execute(
                    "INSERT INTO claim_uses SELECT ?, 1 WHERE ? > 0 ON CONFLICT (claim) "
                    "DO UPDATE SET uses = claim_uses.uses + 1 WHERE claim_uses.uses < ?",
                    (e.claim, limit, limit),
                ).rowcount
                if spent != 1:
                    raise ClaimUsedUpError(f"claim {e.claim} has enrolled {limit} of its {limit} devices")
            db.execute(
                "INSERT INTO enrolled VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device_id) "
                "DO UPDATE SET fingerprint = excluded.fingerprint, serial = excluded.serial, "
                "not_after = excluded.not_after, issued_at = excluded.issued_at, claim = excluded.claim, "
                "hw_serial = excluded.hw_serial, request_id = excluded.request_id, "
                "cert_pem = excluded.cert_pem, chain_pem = excluded.chain_pem",
                (
                    e.device_id, e.fingerprint, e.serial, e.not_after, e.issued_at, e.claim, e.hw_serial,
                    e.request_id, e.cert_pem, e.chain_pem,
                ),
            )  # fmt: skip
            db.execute("DELETE FROM pending WHERE device_id = ?", (e.device_id,))

    def forget_enrolled(self, device_id: str) -> bool:
        """Forget ``device_id``'s enrollment (decommissioned or revoked); whether it was enrolled."""
        with self._writing() as db:
            return bool(db.execute("DELETE FROM enrolled WHERE device_id = ?", (device_id,)).rowcount)

    def claim_uses(self, claim: str) -> int:
        rows = self._rows("SELECT uses FROM claim_uses WHERE claim = ?", claim)
        return 0 if not rows else int(rows[0][0])


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _pending(r: Any) -> Pending:
    return Pending(
        str(r[0]), str(r[1]), _text(r[2]), str(r[3]), str(r[4]), str(r[5]), str(r[6]),
        float(r[7]), float(r[8]), int(r[9]), int(r[10]), str(r[11]),
    )  # fmt: skip


def _enrolled(r: Any) -> Enrolled:
    return Enrolled(
        str(r[0]), str(r[1]), str(r[2]), float(r[3]), float(r[4]), _text(r[5]), _text(r[6]),
        str(r[7]), str(r[8]), str(r[9]),
    )  # fmt: skip
