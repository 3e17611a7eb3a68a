"""The X.509 building blocks every certificate of the fleet's CA is made from.

One place for names, key generation, validity and the extensions of each kind of certificate
(a CA, a device or claim client, the broker's server), so the root, the intermediate, the claims
CA and the leaves they sign agree on them.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes

#: A certificate is valid from a few minutes before it is made, so a device whose clock runs a
#: little behind the controller's does not refuse it as not yet valid.
CLOCK_SKEW = datetime.timedelta(minutes=5)

#: Mode of every private key file and of the directories holding them.
KEY_FILE_MODE = 0o600
DIR_MODE = 0o700


def now() -> datetime.datetime:
    """The current time in UTC (every validity the CA writes is UTC)."""
    return datetime.datetime.now(datetime.timezone.utc)


def common_name(cn: str) -> x509.Name:
    """A subject or issuer name made of one CN."""
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def cn_of(name: x509.Name) -> str | None:
    """The one CN of ``name`` (None when it has none, several, or other attributes too)."""
    attributes = list(name)
    if len(attributes) != 1 or attributes[0].oid != NameOID.COMMON_NAME:
        return None
    value = attributes[0].value
    return value if isinstance(value, str) else None


def serial_text(serial: int) -> str:
    """A serial number as the CA's ledger, the CRL listing and the wire spell it: lower-case hex."""
    return f"{serial:x}"


def key_fingerprint(public_key: CertificatePublicKeyTypes) -> str:
    """SHA-256 of the key's SubjectPublicKeyInfo, hex: names one key pair wherever it travels."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def new_key() -> ec.EllipticCurvePrivateKey:
    """A new ECDSA P-256 key: what every CA and the broker use (devices make their own)."""
    return ec.generate_private_key(ec.SECP256R1())


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write ``key`` as unencrypted PKCS#8 PEM, mode 0600 (temp + fsync + rename)."""
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    atomic_write_bytes(path, pem, mode=KEY_FILE_MODE)


def write_cert(path: Path, *certs: x509.Certificate) -> None:
    """Write ``certs`` as PEM, in order, mode 0644 (certificates are public)."""
    atomic_write_bytes(path, b"".join(pem(cert) for cert in certs), mode=0o644)


def pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def read_key(path: Path) -> CertificateIssuerPrivateKeyTypes:
    """A CA's private key (ConfigError naming the file when it is missing or not a key)."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read the CA key {path}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path} is not an EC private key; make the CA with `edge-agent fleet ca init`")
    return key


def read_cert(path: Path) -> x509.Certificate:
    """The first certificate of a PEM file (ConfigError naming the file)."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the certificate {path}: {exc}") from exc


def ca_certificate(
    subject: str,
    public_key: CertificatePublicKeyTypes,
    signer: CertificateIssuerPrivateKeyTypes,
    issuer: x509.Certificate | None,
    days: int,
    *,
    path_length: int | None,
) -> x509.Certificate:
    """A CA certificate for ``subject``: self-signed when ``issuer`` is None, else signed by it."""
    start = now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(common_name(subject))
        .issuer_name(issuer.subject if issuer is not None else common_name(subject))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - CLOCK_SKEW)
        .not_valid_after(_capped(start + datetime.timedelta(days=days), issuer))
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(_ca_usage(), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    if issuer is not None:
        builder = builder.add_extension(_authority_key_id(issuer), critical=False)
    return builder.sign(signer, hashes.SHA256())


def leaf_certificate(
    subject: str,
    public_key: CertificatePublicKeyTypes,
    signer: CertificateIssuerPrivateKeyTypes,
    issuer: x509.Certificate,
    not_after: datetime.datetime,
    *,
    server_names: tuple[str, ...] = (),
) -> x509.Certificate:
    """A client certificate (no ``server_names``) or the broker's server certificate, signed by ``issuer``."""
    start = now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(common_name(subject))
        .issuer_name(issuer.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - CLOCK_SKEW)
        .not_valid_after(_capped(not_after, issuer))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(_authority_key_id(issuer), critical=False)
    )
    if server_names:
        usage = ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in server_names]), critical=False
        )
    else:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    return builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).sign(signer, hashes.SHA256())


def _capped(not_after: datetime.datetime, issuer: x509.Certificate | None) -> datetime.datetime:
    # A certificate outliving its issuer would fail verification from the day the issuer expires.
    if issuer is None:
        return not_after
    return min(not_after, issuer.not_valid_after_utc)


def _ca_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )


def _authority_key_id(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
