"""Ed25519 keys and detached signatures for deploy manifests (``cryptography``).

Keys are read as PEM (PKCS#8 private, SubjectPublicKeyInfo public: what :func:`generate_keypair`
writes and ``openssl genpkey -algorithm ed25519`` makes) or as the raw 32-byte key in base64 (what
other Ed25519 tools print). A signature covers the exact bytes it is given, nothing re-serialised.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import ConfigError

__all__ = [
    "PUBLIC_PEM_FORM",
    "Ed25519PrivateKey",
    "Ed25519PublicKey",
    "generate_keypair",
    "key_fingerprint",
    "load_private_key",
    "load_public_key",
    "private_key_from_bytes",
    "public_key_from_bytes",
    "sign",
    "verify",
]

_RAW_KEY_BYTES = 32


def generate_keypair() -> tuple[bytes, bytes]:
    """A new key pair as ``(private_pem, public_pem)``: unencrypted PKCS#8 and SubjectPublicKeyInfo."""
    private = Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def _raw_key(data: bytes) -> bytes | None:
    """The 32 raw key bytes if ``data`` is base64 of exactly that, else None."""
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == _RAW_KEY_BYTES else None


def private_key_from_bytes(data: bytes, what: str = "private key") -> Ed25519PrivateKey:
    """Parse a PEM or raw-base64 Ed25519 private key; ValueError saying what is wrong."""
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"{what}: not a readable unencrypted PEM private key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{what}: PEM key is {type(key).__name__}, not Ed25519")
        return key
    raw = _raw_key(data)
    if raw is None:
        raise ValueError(f"{what}: neither PEM nor a base64 raw 32-byte Ed25519 key")
    return Ed25519PrivateKey.from_private_bytes(raw)


#: The one PEM form a public key file takes, as the operator sees it in the file.
PUBLIC_PEM_FORM = "an Ed25519 public key in PEM (-----BEGIN PUBLIC KEY-----, the .pub of `fleet keygen`)"


def public_key_from_bytes(data: bytes, what: str = "public key") -> Ed25519PublicKey:
    """Parse a PEM or raw-base64 Ed25519 public key; ValueError saying what is wrong."""
    # The two near misses operators make, named instead of reported as "not PEM": the private key
    # copied where its public half belongs (a secret leaked onto every device), and an OpenSSH key.
    if b"PRIVATE KEY-----" in data:
        raise ValueError(f"{what}: holds a PRIVATE key; give {PUBLIC_PEM_FORM}, never the private key")
    if data.lstrip().startswith((b"ssh-ed25519 ", b"ssh-rsa ", b"ecdsa-sha2-")):
        raise ValueError(f"{what}: is an OpenSSH public key; give {PUBLIC_PEM_FORM}")
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"{what}: not a readable PEM public key ({exc})") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{what}: PEM key is {type(key).__name__}, not Ed25519")
        return key
    raw = _raw_key(data)
    if raw is None:
        raise ValueError(f"{what}: neither PEM nor a base64 raw 32-byte Ed25519 key; give {PUBLIC_PEM_FORM}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror or exc}; check the path") from exc


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read an Ed25519 private key file (PEM or raw base64); ConfigError naming the file otherwise."""
    try:
        return private_key_from_bytes(_read(path), f"key file {path}")
    except ValueError as exc:
        raise ConfigError(f"{exc}; make one with `edge-agent fleet keygen`") from exc


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key file (PEM or raw base64); ConfigError naming the file otherwise."""
    try:
        return public_key_from_bytes(_read(path), f"key file {path}")
    except ValueError as exc:
        raise ConfigError(f"{exc}; copy the .pub file `edge-agent fleet keygen` wrote") from exc


def sign(private_key: Ed25519PrivateKey, data: bytes) -> bytes:
    """The 64-byte Ed25519 signature of exactly ``data``."""
    return private_key.sign(data)


def verify(public_key: Ed25519PublicKey, data: bytes, signature: bytes) -> bool:
    """True if ``signature`` is ``public_key``'s signature of exactly ``data``."""
    try:
        public_key.verify(signature, data)
    except InvalidSignature:
        return False
    return True


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """A short stable id of a public key (first 16 hex digits of the SHA-256 of its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]
