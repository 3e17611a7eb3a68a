"""The issued-certificates ledger: every device certificate the CA signed, until it is long expired.

It is what revocation reads (a device id to the serials it holds) and what the CRL is made from.
One JSON file in the CA directory, written temp + fsync + rename under the CA directory's lock.
A record leaves the ledger a day after its certificate expires: an expired certificate is refused
by the broker anyway, so neither the ledger nor the CRL grows with renewals.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from agent.errors import ConfigError
from agent.fleet.ca.pki import now
from agent.fsutil import atomic_write_json

#: How long after its expiry a certificate's record is kept (and a revoked one listed in the CRL).
KEEP_AFTER_EXPIRY = datetime.timedelta(days=1)


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


class IssuedLedger(BaseModel):
    """The ledger file's content."""

    model_config = ConfigDict(extra="forbid")

    certificates: list[IssuedRecord] = []

    def pruned(self) -> IssuedLedger:
        """The ledger without the records of certificates expired longer than :data:`KEEP_AFTER_EXPIRY`."""
        cutoff = now() - KEEP_AFTER_EXPIRY
        return IssuedLedger(certificates=[r for r in self.certificates if r.not_after >= cutoff])

    def revoked(self) -> list[IssuedRecord]:
        """The records the CRL lists."""
        return [r for r in self.certificates if r.revoked_at is not None]


def read_ledger(path: Path) -> IssuedLedger:
    """The ledger at ``path`` (empty when there is none yet; ConfigError naming a damaged file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return IssuedLedger()
    try:
        return IssuedLedger.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"the issued-certificates ledger {path} is damaged: {exc}") from exc


def write_ledger(path: Path, ledger: IssuedLedger) -> None:
    """Write ``ledger`` pruned (temp + fsync + rename, mode 0600: it names every device)."""
    atomic_write_json(path, ledger.pruned().model_dump(mode="json"), mode=0o600)
