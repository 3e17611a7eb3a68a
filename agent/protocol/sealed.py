"""Sealed secrets: one value of a configuration overlay encrypted to one device's enrollment key.

Format of a sealed value (a string in the overlay YAML)::

    sealed:v1:<base64url(ephemeral P-256 public key, uncompressed, 65 bytes
                         || AES-256-GCM nonce, 12 bytes || ciphertext and tag)>

The key is HKDF-SHA256 over the ECDH secret of the ephemeral key and the device's key (no salt,
``info = b"edge-agent sealed secret v1|" + device_id``); the associated data is
``device_id + "|" + dotted key path``, so a value opens only on its device and only under the key
it was sealed for (moved to another key, or to another device's overlay, it is refused). The
operator side seals with the public key of the device's certificate; the device opens with its
private key (``mqtt.tls.key_file``).
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: What every sealed value starts with.
SEALED_PREFIX = "sealed:v1:"
_INFO = b"edge-agent sealed secret v1|"
_POINT_BYTES = 65
_NONCE_BYTES = 12
_TAG_BYTES = 16
#: Largest clear value a sealed string may carry (a password, a token; not a file).
MAX_SEALED_BYTES = 4096


class SealedValueError(ValueError):
    """A sealed value that cannot be opened here: malformed, for another device or key, or tampered."""


def is_sealed(value: object) -> bool:
    """True when ``value`` is a string in the sealed format (it may still fail to open)."""
    return isinstance(value, str) and value.startswith(SEALED_PREFIX)


def seal(value: bytes, public_key: ec.EllipticCurvePublicKey, device_id: str, key_path: str) -> str:
    """``value`` sealed to the device that holds the private half of ``public_key``, for ``key_path``."""
    if len(value) > MAX_SEALED_BYTES:
        raise ValueError(f"a sealed value holds at most {MAX_SEALED_BYTES} bytes, not {len(value)}")
    if not isinstance(public_key.curve, ec.SECP256R1):
        raise TypeError("sealed values are for a device's P-256 enrollment key")
    ephemeral = ec.generate_private_key(ec.SECP256R1())
    point = ephemeral.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    key = _key(ephemeral.exchange(ec.ECDH(), public_key), device_id)
    nonce = os.urandom(_NONCE_BYTES)
    sealed = AESGCM(key).encrypt(nonce, value, _aad(device_id, key_path))
    return SEALED_PREFIX + base64.urlsafe_b64encode(point + nonce + sealed).decode("ascii").rstrip("=")


def open_sealed(text: str, private_key: ec.EllipticCurvePrivateKey, device_id: str, key_path: str) -> bytes:
    """The clear value of ``text`` sealed for ``device_id`` and ``key_path``; SealedValueError otherwise."""
    if not is_sealed(text):
        raise SealedValueError(f"{key_path}: not a sealed value (it must start with {SEALED_PREFIX})")
    body = text[len(SEALED_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError) as exc:
        raise SealedValueError(f"{key_path}: the sealed value is not base64url ({exc})") from exc
    if len(raw) < _POINT_BYTES + _NONCE_BYTES + _TAG_BYTES:
        raise SealedValueError(f"{key_path}: the sealed value is too short to hold a key, nonce and tag")
    point, nonce, sealed = (
        raw[:_POINT_BYTES],
        raw[_POINT_BYTES : _POINT_BYTES + _NONCE_BYTES],
        raw[_POINT_BYTES + _NONCE_BYTES :],
    )
    try:
        ephemeral = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    except ValueError as exc:
        raise SealedValueError(f"{key_path}: the sealed value's ephemeral key is not a P-256 point") from exc
    key = _key(private_key.exchange(ec.ECDH(), ephemeral), device_id)
    try:
        return AESGCM(key).decrypt(nonce, sealed, _aad(device_id, key_path))
    except InvalidTag as exc:
        raise SealedValueError(
            f"{key_path}: the sealed value does not open with this device's key: sealed for another "
            "device or another key, or altered on the way"
        ) from exc


def _key(shared: bytes, device_id: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + device_id.encode()).derive(
        shared
    )


def _aad(device_id: str, key_path: str) -> bytes:
    return f"{device_id}|{key_path}".encode()
