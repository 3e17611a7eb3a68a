"""The device's key pair and what it asks for with it: made here, kept here (0600), never sent.

An ECDSA P-256 key (what the fleet's CA accepts and the smallest TLS handshake), written atomically
with mode 0600 (:mod:`agent.fsutil`); a PKCS#10 request whose subject CN is the device id; and the
facts of a certificate the device holds (serial, expiry, issuer, whether it is for this key).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes

#: Mode of every private key file the device writes.
KEY_FILE_MODE = 0o600

DevicePrivateKey = ec.EllipticCurvePrivateKey


def load_or_make_key(path: Path) -> DevicePrivateKey:
    """The device key at ``path``; made (P-256, 0600, atomically) when there is none yet.

    A key that exists is kept: a request asked again after a restart is for the same key, so the
    operator's pending entry and an issued certificate still match it.
    """
    if path.exists():
        return load_key(path)
    key = ec.generate_private_key(ec.SECP256R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    atomic_write_bytes(path, pem, mode=KEY_FILE_MODE)
    return key


def load_key(path: Path, key: str = "mqtt.tls.key_file") -> DevicePrivateKey:
    """An EC private key from a PEM file; ConfigError naming the configuration ``key`` and the file."""
    try:
        loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: cannot read the private key {path} ({exc})") from exc
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{key}: {path} is not an EC private key (enrollment signs with ECDSA)")
    return loaded


def certificate_request(key: DevicePrivateKey, device_id: str) -> str:
    """A PKCS#10 request (PEM) for ``device_id`` as subject CN, signed by ``key`` (ECDSA-SHA256)."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


@dataclass(frozen=True)
class CertificateFacts:
    """What the device needs to know of a certificate it holds or is handed."""

    serial: str  # hex
    not_before: float  # Unix seconds
    not_after: float
    issuer: str  # the issuer's common name
    subject: str  # the subject's common name

    def renew_at(self, fraction: float) -> float:
        """When ``fraction`` of the certificate's life has passed (Unix seconds)."""
        return self.not_before + fraction * (self.not_after - self.not_before)

    def days_left(self, now: float) -> float:
        """Days until expiry from ``now`` (negative once expired)."""
        return (self.not_after - now) / 86400.0


def _common_name(name: x509.Name) -> str:
    values = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = values[0].value if values else ""
    return value if isinstance(value, str) else value.decode(errors="replace")


def certificate_facts(cert: x509.Certificate) -> CertificateFacts:
    """Serial, validity, issuer and subject CN of ``cert``."""
    return CertificateFacts(
        serial=f"{cert.serial_number:x}",
        not_before=cert.not_valid_before_utc.timestamp(),
        not_after=cert.not_valid_after_utc.timestamp(),
        issuer=_common_name(cert.issuer),
        subject=_common_name(cert.subject),
    )


def first_certificate(pem: bytes) -> x509.Certificate:
    """The first certificate of a PEM file or text (the leaf of a cert + chain file)."""
    certs = x509.load_pem_x509_certificates(pem)
    return certs[0]


def is_for_key(cert: x509.Certificate, key: DevicePrivateKey) -> bool:
    """Whether ``cert`` certifies the public half of ``key``."""
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt))
