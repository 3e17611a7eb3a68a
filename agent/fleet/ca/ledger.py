"""The issued-certificates ledger: every device certificate the CA signed, until it is long expired.

It is what revocation reads (a device id to the serials it holds), what the CRL and the devices
ACL are made from. A SQLite file in the CA directory (mode 0600: it names every device), so that
recording a certificate costs the same at the thousandth device as at the first, and the
controller and a CLI command in another process never interleave a write. A record leaves the
ledger a day after its certificate expires: an expired certificate is refused by the broker
anyway, so neither the ledger nor the CRL grows with renewals.

Each record keeps the certificate itself (PEM, at most :data:`MAX_CERT_PEM` bytes), so the operator
side finds a device's current key without asking anyone for its certificate (a secret sealed to it).
Records made before the ledger kept certificates have none; the column is added to such a ledger on
its first use.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agent.fleet.ca.pki import now

#: How long after its expiry a certificate's record is kept (and a revoked one listed in the CRL).
KEEP_AFTER_EXPIRY = datetime.timedelta(days=1)
#: Largest certificate kept (a device certificate of this CA is under 1 KiB as PEM).
MAX_CERT_PEM = 8 * 1024
#: How long a writer waits for another process's transaction on the ledger.
_BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS certificates (
    serial TEXT PRIMARY KEY,
    device_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    issued_at REAL NOT NULL,
    not_after REAL NOT NULL,
    revoked_at REAL,
    reason TEXT,
    cert_pem TEXT
);
CREATE INDEX IF NOT EXISTS certificates_by_device ON certificates (device_id, not_after);
"""
_SELECT = (
    "SELECT serial, device_id, fingerprint, issued_at, not_after, revoked_at, reason, cert_pem "
    "FROM certificates "
)


class IssuedRecord(BaseModel):
    """One certificate the CA signed for a device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    serial: str
    device_id: str
    fingerprint: str
    issued_at: datetime.datetime
    not_after: datetime.datetime
    revoked_at: datetime.datetime | None = None
    reason: str | None = None
    #: The certificate as PEM (None in a record made before the ledger kept certificates).
    cert_pem: str | None = Field(None, max_length=MAX_CERT_PEM)


class IssuedLedger:
    """The ledger at ``path`` (made on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, record: IssuedRecord) -> None:
        """Record a certificate just issued (and forget those long expired)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO certificates (serial, device_id, fingerprint, issued_at, not_after, revoked_at, "
                "reason, cert_pem) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.serial,
                    record.device_id,
                    record.fingerprint,
                    record.issued_at.timestamp(),
                    record.not_after.timestamp(),
                    _stamp(record.revoked_at),
                    record.reason,
                    record.cert_pem,
                ),
            )
            db.execute("DELETE FROM certificates WHERE not_after < ?", (_cutoff(),))

    def revoke(self, device_id: str, reason: str) -> list[str]:
        """Mark every unexpired, unrevoked certificate of ``device_id`` revoked; their serials."""
        at = now().timestamp()
        with self._transaction() as db:
            rows = db.execute(
                "SELECT serial FROM certificates "
                "WHERE device_id = ? AND revoked_at IS NULL AND not_after > ?",
                (device_id, at),
            ).fetchall()
            serials = [str(row[0]) for row in rows]
            db.executemany(
                "UPDATE certificates SET revoked_at = ?, reason = ? WHERE serial = ?",
                [(at, reason, serial) for serial in serials],
            )
        return serials

    def of_device(self, device_id: str) -> list[IssuedRecord]:
        """The records of ``device_id``, oldest first (revoked ones included)."""
        return self._select(_SELECT + "WHERE device_id = ? ORDER BY issued_at", (device_id,))

    def current_certificate(self, device_id: str) -> IssuedRecord | None:
        """The newest unrevoked, unexpired record of ``device_id`` that keeps its certificate (None when
        there is none: never issued, revoked, expired, or issued before the ledger kept certificates)."""
        query = _SELECT + (
            "WHERE device_id = ? AND revoked_at IS NULL AND not_after > ? AND cert_pem IS NOT NULL "
            "ORDER BY issued_at DESC LIMIT 1"
        )
        found = self._select(query, (device_id, now().timestamp()))
        return found[0] if found else None

    def revoked(self) -> list[IssuedRecord]:
        """The revoked certificates the CRL lists (until a day after each expires)."""
        query = _SELECT + "WHERE revoked_at IS NOT NULL AND not_after >= ? ORDER BY revoked_at"
        return self._select(query, (_cutoff(),))

    def is_denied(self, device_id: str) -> bool:
        """Whether ``device_id`` is among :meth:`denied_devices` (one device's rows read, not all)."""
        at = now().timestamp()
        with self._transaction() as db:
            revoked, good = db.execute(
                "SELECT COALESCE(SUM(revoked_at IS NOT NULL), 0), COALESCE(SUM(revoked_at IS NULL), 0) "
                "FROM certificates WHERE device_id = ? AND not_after > ?",
                (device_id, at),
            ).fetchone()
        return bool(revoked) and not good

    def denied_devices(self) -> list[str]:
        """Devices holding a revoked, unexpired certificate and no unexpired one that is not revoked."""
        at = now().timestamp()
        with self._transaction() as db:
            rows = db.execute(
                "SELECT device_id FROM certificates WHERE not_after > ? GROUP BY device_id "
                "HAVING SUM(revoked_at IS NULL) = 0 ORDER BY device_id",
                (at,),
            ).fetchall()
        return [str(row[0]) for row in rows]

    def _select(self, query: str, args: tuple[object, ...]) -> list[IssuedRecord]:
        with self._transaction() as db:
            rows = db.execute(query, args).fetchall()
        return [_record(row) for row in rows]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        new = not self.path.exists()
        db = sqlite3.connect(str(self.path), timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        try:
            if new:
                os.chmod(self.path, 0o600)
            db.execute("PRAGMA synchronous = FULL")
            db.executescript(_SCHEMA)
            db.execute("BEGIN IMMEDIATE")
            try:
                _migrate(db)
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a ledger made by an older version to this schema (inside the write lock: one process does it)."""
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(certificates)")}
    if "cert_pem" not in columns:
        db.execute("ALTER TABLE certificates ADD COLUMN cert_pem TEXT")


def _cutoff() -> float:
    return (now() - KEEP_AFTER_EXPIRY).timestamp()


def _stamp(at: datetime.datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def _time(value: object) -> datetime.datetime:
    assert isinstance(value, float | int)
    return datetime.datetime.fromtimestamp(value, datetime.timezone.utc)


def _record(row: tuple[object, ...]) -> IssuedRecord:
    serial, device_id, fingerprint, issued_at, not_after, revoked_at, reason, cert_pem = row
    return IssuedRecord(
        serial=str(serial),
        device_id=str(device_id),
        fingerprint=str(fingerprint),
        issued_at=_time(issued_at),
        not_after=_time(not_after),
        revoked_at=_time(revoked_at) if revoked_at is not None else None,
        reason=str(reason) if reason is not None else None,
        cert_pem=str(cert_pem) if cert_pem is not None else None,
    )
