"""Claims: the bootstrap credential a new device enrolls with, made by the claims CA and checked here.

A claim is a certificate of the claims CA (a CA of its own, trusted only by the broker's
enrollment listener) with subject CN ``claim:{name}``, and its key. ``fleet ca claim`` writes it
as a bundle for the devices of a batch and records its name, serial, uses and expiry in the
claims ledger, which the controller counts uses against. A device proves it holds a claim by
signing its request with the claim key (ECDSA-SHA256): :func:`verify_claim`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, ConfigDict

from agent.errors import UsageError
from agent.fleet.ca.layout import CaDir, make_private_dir, read_json_model
from agent.fleet.ca.pki import (
    cn_of,
    leaf_certificate,
    new_key,
    now,
    read_cert,
    read_key,
    serial_text,
    write_cert,
    write_key,
)
from agent.fleet.ca.refusal import Refused
from agent.fsutil import atomic_write_json
from agent.names import NAME_PATTERN, NAME_RULE

#: A claim's subject CN is this followed by its name; ':' is in no device id.
CLAIM_CN_PREFIX = "claim:"
#: A claim certificate larger than this is refused unread.
MAX_CLAIM_CERT_BYTES = 8 * 1024
#: The most uses and days a claim may be made with.
MAX_CLAIM_USES = 1_000_000
MAX_CLAIM_DAYS = 3650

ClaimCode = Literal["bad_claim", "claim_expired", "bad_claim_signature"]


class ClaimRefused(Refused[ClaimCode]):
    """A claim the controller will not accept: ``code`` for the reply, ``message`` one line saying why."""


@dataclass(frozen=True)
class ClaimProof:
    """A claim that verified: its name, its serial (lower-case hex) and its expiry."""

    name: str
    serial: str
    not_after: datetime.datetime


class ClaimRecord(BaseModel):
    """One claim made by ``fleet ca claim``: how many devices may enroll with it, and until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    serial: str
    uses: int
    issued_at: datetime.datetime
    not_after: datetime.datetime


class ClaimLedger(BaseModel):
    """The claims ledger file's content."""

    model_config = ConfigDict(extra="forbid")

    claims: list[ClaimRecord] = []


@dataclass(frozen=True)
class ClaimBundle:
    """The files of a claim, as a device is given them."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    record: ClaimRecord


def read_claims(ca_dir: Path) -> dict[str, ClaimRecord]:
    """The claims made so far, by name (ConfigError naming a damaged ledger)."""
    ledger = read_json_model(CaDir(Path(ca_dir)).claims, ClaimLedger, "the claims ledger")
    return {record.name: record for record in ledger.claims}


def make_claim(ca_dir: Path, name: str, *, uses: int, days: int, out_dir: Path) -> ClaimBundle:
    """Issue claim ``name`` for ``uses`` enrollments over ``days``; write its bundle into ``out_dir``.

    The bundle: ``claim.crt``, ``claim.key`` (0600) and ``ca.crt`` (the device root, the ``ca_file``
    a device verifies the broker with). A name is used once: a second claim of that name is refused.
    """
    if not NAME_PATTERN.match(name):
        raise UsageError(f"claim name {name!r}: {NAME_RULE}")
    if not 1 <= uses <= MAX_CLAIM_USES:
        raise UsageError(f"--uses must be 1-{MAX_CLAIM_USES}, not {uses}")
    if not 1 <= days <= MAX_CLAIM_DAYS:
        raise UsageError(f"--days must be 1-{MAX_CLAIM_DAYS}, not {days}")
    layout = CaDir(Path(ca_dir))
    claims_ca, claims_key = read_cert(layout.claims_cert), read_key(layout.claims_key)
    with layout.locked():
        known = read_claims(layout.path)
        if name in known:
            raise UsageError(
                f"a claim named {name!r} exists already (until {known[name].not_after:%Y-%m-%d}); "
                "choose another name"
            )
        key = new_key()
        cert = leaf_certificate(
            CLAIM_CN_PREFIX + name,
            key.public_key(),
            claims_key,
            claims_ca,
            now() + datetime.timedelta(days=days),
        )
        record = ClaimRecord(
            name=name,
            serial=serial_text(cert.serial_number),
            uses=uses,
            issued_at=now(),
            not_after=cert.not_valid_after_utc,
        )
        make_private_dir(out_dir)
        bundle = ClaimBundle(out_dir / "claim.crt", out_dir / "claim.key", out_dir / "ca.crt", record)
        write_key(bundle.key_file, key)
        write_cert(bundle.cert_file, cert)
        write_cert(bundle.ca_file, read_cert(layout.root_cert))
        ledger = ClaimLedger(claims=[*known.values(), record])
        atomic_write_json(layout.claims, ledger.model_dump(mode="json"), mode=0o600)
    return bundle


def verify_claim(
    claim_cert_pem: bytes, signature: bytes, signed_bytes: bytes, claims_ca: x509.Certificate
) -> ClaimProof:
    """Check that ``claim_cert_pem`` is a current claim of ``claims_ca`` and that its key signed
    ``signed_bytes`` (ECDSA-SHA256, DER ``signature``). Raises :class:`ClaimRefused`.

    Uses are not counted here: the controller compares the proof with :func:`read_claims`.
    """
    if len(claim_cert_pem) > MAX_CLAIM_CERT_BYTES:
        raise ClaimRefused(
            "bad_claim",
            f"the claim certificate is {len(claim_cert_pem)} bytes; at most {MAX_CLAIM_CERT_BYTES}",
        )
    try:
        cert = x509.load_pem_x509_certificate(claim_cert_pem)
        cert.verify_directly_issued_by(claims_ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise ClaimRefused(
            "bad_claim", f"not a claim of this fleet's claims CA ({exc or type(exc).__name__})"
        ) from exc
    cn = cn_of(cert.subject) or ""
    if not cn.startswith(CLAIM_CN_PREFIX):
        raise ClaimRefused("bad_claim", f"the certificate's subject {cn!r} is not a claim:NAME")
    at = now()
    if at < cert.not_valid_before_utc:
        raise ClaimRefused(
            "bad_claim", f"the claim is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )
    if at >= cert.not_valid_after_utc:
        raise ClaimRefused(
            "claim_expired", f"the claim expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    public_key = cert.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ClaimRefused("bad_claim", "a claim's key is an EC key")
    try:
        public_key.verify(signature, signed_bytes, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature as exc:
        raise ClaimRefused("bad_claim_signature", "the request is not signed by the claim's key") from exc
    return ClaimProof(
        cn.removeprefix(CLAIM_CN_PREFIX), serial_text(cert.serial_number), cert.not_valid_after_utc
    )
