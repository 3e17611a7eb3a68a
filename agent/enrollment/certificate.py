"""The device's certificate: what a reply must hold before it is taken, and writing it.

A reply is taken only when it answers this device's latest request (its ``request_id``) and its
certificate is for this device's key and id: anything else (a replay, a reply meant for another
request, a certificate for another key) is a :class:`ForeignReplyError`, ignored and counted by the caller.
The certificate and its chain go into one file (leaf first, what TLS presents), written atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from agent.enrollment.keys import CertificateFacts, DevicePrivateKey, certificate_facts, is_for_key
from agent.fsutil import atomic_write_bytes
from agent.protocol.enrollment import EnrollReply
from agent.protocol.messages import CertificateInfo

#: Mode of the certificate file: public, as a certificate is.
CERT_FILE_MODE = 0o644


class ForeignReplyError(Exception):
    """A reply this device did not ask for, or whose certificate is not for its key and id."""


def issued_certificate(
    reply: EnrollReply, *, request_id: str, key: DevicePrivateKey, device_id: str
) -> tuple[bytes, CertificateFacts]:
    """The certificate file's bytes (leaf + chain) and the leaf's facts, from an ``issued`` reply.

    Raises ForeignReplyError naming what does not match.
    """
    if reply.request_id != request_id:
        raise ForeignReplyError(f"answers request {reply.request_id!r}, not {request_id!r}")
    if reply.outcome != "issued" or not reply.cert_pem:
        raise ForeignReplyError(f"outcome {reply.outcome!r} carries no certificate")
    try:
        certs = x509.load_pem_x509_certificates(reply.cert_pem.encode())
        chain = x509.load_pem_x509_certificates(reply.chain_pem.encode()) if reply.chain_pem else []
    except ValueError as exc:
        raise ForeignReplyError(f"certificate does not parse ({exc})") from exc
    leaf = certs[0]
    if not is_for_key(leaf, key):
        raise ForeignReplyError("certificate is for another key")
    facts = certificate_facts(leaf)
    if facts.subject != device_id:
        raise ForeignReplyError(f"certificate is for {facts.subject!r}, not {device_id!r}")
    if facts.not_after <= time.time():
        raise ForeignReplyError("certificate has expired")
    pem = b"".join(c.public_bytes(Encoding.PEM) for c in [leaf, *chain])
    return pem, facts


def write_certificate(path: Path, pem: bytes) -> None:
    """Replace the certificate file atomically (temp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, pem, mode=CERT_FILE_MODE)


def held_certificate(path: Path) -> CertificateFacts | None:
    """The facts of the certificate in ``path`` (its leaf), or None when there is none readable."""
    try:
        return certificate_facts(x509.load_pem_x509_certificates(path.read_bytes())[0])
    except (OSError, ValueError):
        return None


class HeldCertificate:
    """The certificate the device connects with, as up/info and telemetry report it."""

    def __init__(
        self,
        facts: Callable[[], CertificateFacts | None],
        counts: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """``facts``: the current certificate's; ``counts``: renewal counters to report beside it."""
        self._facts = facts
        self._counts = counts

    def info(self) -> CertificateInfo | None:
        """``up/info``'s ``certificate``: serial, expiry and issuer (None without a certificate)."""
        facts = self._facts()
        if facts is None:
            return None
        return CertificateInfo(serial=facts.serial[:64], not_after=facts.not_after, issuer=facts.issuer[:300])

    def stats(self) -> dict[str, float]:
        """Telemetry ``cert.*``: days to expiry, and the renewal's counters when it runs."""
        out = dict(self._counts()) if self._counts is not None else {}
        facts = self._facts()
        if facts is not None:
            out["days_to_expiry"] = round(facts.days_left(time.time()), 3)
        return out
