"""A device's certificate signing request, checked before anything is signed: pure, no I/O.

The request comes from a device that holds nothing but a claim, so every part of it is untrusted:
its size, its encoding, its signature (it proves the device holds the key), its subject (the
device id it asks for, and only that) and its key (EC P-256/P-384 or RSA of 2048 bits or more).
Each refusal is a :class:`CsrRefused` with a code the device reads in its reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

from agent.fleet.ca.pki import cn_of, key_fingerprint
from agent.fleet.ca.refusal import Refused
from agent.names import NAME_PATTERN, NAME_RULE

#: A CSR larger than this is refused unread: an RSA 4096 request is under 2 KiB of PEM.
MAX_CSR_BYTES = 16 * 1024

#: The smallest RSA key accepted; smaller is ``weak_key``.
MIN_RSA_BITS = 2048

#: The curves accepted for EC keys; any other is ``unsupported_key``.
EC_CURVES = ("secp256r1", "secp384r1")

CsrCode = Literal["bad_csr", "bad_signature", "wrong_subject", "weak_key", "unsupported_key", "bad_device_id"]


class CsrRefused(Refused[CsrCode]):
    """A CSR the CA will not sign: ``code`` for the device's reply, ``message`` one line saying why."""


@dataclass(frozen=True)
class CheckedCsr:
    """A CSR that passed every check: the device id it is for, its key and that key's fingerprint."""

    device_id: str
    public_key: CertificatePublicKeyTypes
    fingerprint: str


def check_csr(csr_pem: bytes, device_id: str) -> CheckedCsr:
    """Check ``csr_pem`` as a request for ``device_id``'s certificate (raises :class:`CsrRefused`)."""
    _check_device_id(device_id, "the requested device id")
    if len(csr_pem) > MAX_CSR_BYTES:
        raise CsrRefused("bad_csr", f"the CSR is {len(csr_pem)} bytes; at most {MAX_CSR_BYTES} are read")
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        signature_valid = csr.is_signature_valid
        public_key = csr.public_key()
        subject = csr.subject
    except ValueError as exc:
        raise CsrRefused("bad_csr", f"not a PEM certificate signing request ({exc})") from exc
    if not signature_valid:
        raise CsrRefused("bad_signature", "the CSR's signature does not match its public key")
    _check_key(public_key)
    cn = cn_of(subject)
    if cn is None:
        raise CsrRefused("wrong_subject", "the CSR's subject must be exactly one CN, the device id")
    _check_device_id(cn, "the CSR's subject CN")
    if cn != device_id:
        raise CsrRefused("wrong_subject", f"the CSR is for {cn!r}, the request for {device_id!r}")
    return CheckedCsr(device_id, public_key, key_fingerprint(public_key))


def _check_device_id(device_id: str, what: str) -> None:
    if not NAME_PATTERN.match(device_id):
        shown = device_id if len(device_id) <= 80 else device_id[:80] + "..."
        raise CsrRefused("bad_device_id", f"{what} {shown!r} is not a device id: {NAME_RULE}")


def _check_key(public_key: CertificatePublicKeyTypes) -> None:
    if isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < MIN_RSA_BITS:
            raise CsrRefused(
                "weak_key", f"RSA {public_key.key_size} is too weak; use EC P-256 or RSA >= {MIN_RSA_BITS}"
            )
        return
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if public_key.curve.name not in EC_CURVES:
            raise CsrRefused(
                "unsupported_key", f"curve {public_key.curve.name} is not accepted; use P-256 or P-384"
            )
        return
    raise CsrRefused("unsupported_key", f"{type(public_key).__name__} keys are not accepted; use EC P-256")
