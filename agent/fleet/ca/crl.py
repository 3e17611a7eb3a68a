"""The devices intermediate's certificate revocation list, the file the broker's ``crlfile`` names.

OpenSSL refuses every client certificate when the CRL's nextUpdate has passed, so the list is
long-lived (:data:`CRL_DAYS`) and re-issued whenever less than half of its life is left
(:func:`crl_due`): by the controller when it loads the CA, by every revocation, and by
``edge-agent fleet ca crl`` run from a timer (docs/enrollment.md).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

from agent.fleet.ca.ledger import IssuedRecord
from agent.fleet.ca.pki import CLOCK_SKEW, now
from agent.fsutil import atomic_write_bytes

#: The CRL's life (its nextUpdate after its lastUpdate).
CRL_DAYS = 90


def write_crl(
    path: Path,
    revoked: list[IssuedRecord],
    issuer: x509.Certificate,
    key: CertificateIssuerPrivateKeyTypes,
    days: int = CRL_DAYS,
) -> x509.CertificateRevocationList:
    """Sign a CRL listing ``revoked`` and write it to ``path`` (temp + fsync + rename, mode 0644)."""
    start = now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(start - CLOCK_SKEW)
        .next_update(start + datetime.timedelta(days=days))
    )
    for record in revoked:
        assert record.revoked_at is not None
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(int(record.serial, 16))
            .revocation_date(record.revoked_at)
            .build()
        )
        builder = builder.add_revoked_certificate(entry)
    crl = builder.sign(key, hashes.SHA256())
    atomic_write_bytes(path, crl.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return crl


def read_crl(path: Path) -> x509.CertificateRevocationList | None:
    """The CRL at ``path``, or None when there is none or it cannot be read."""
    try:
        return x509.load_pem_x509_crl(path.read_bytes())
    except (OSError, ValueError):
        return None


def crl_due(path: Path, at: datetime.datetime | None = None) -> bool:
    """Whether the CRL at ``path`` is missing, unreadable or past half of its life."""
    crl = read_crl(path)
    if crl is None or crl.next_update_utc is None:
        return True
    at = at or now()
    half = crl.last_update_utc + (crl.next_update_utc - crl.last_update_utc) / 2
    return at >= half
