"""The manifest's signature: Ed25519 over the manifest's exact UTF-8 bytes, by a key id the device trusts.

The operator signs the manifest text (:func:`signature_for`); the device checks the envelope's key
id and signature before it reads the manifest (:func:`check_signature`). A present signature is
always checked, even when none is required; every refusal names what to do.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from agent.protocol.delivery_errors import BadSignatureError, UnknownKeyError, UnsignedError
from agent.signing import Ed25519PrivateKey, Ed25519PublicKey, sign, verify


def signature_for(text: str, private_key: Ed25519PrivateKey) -> str:
    """The base64 Ed25519 signature of ``text``'s UTF-8 bytes."""
    return base64.b64encode(sign(private_key, text.encode("utf-8"))).decode("ascii")


def decode_signature(signature: str, job_id: str | None) -> bytes:
    """The raw bytes of a base64 signature; :class:`BadSignatureError` when it is not base64."""
    try:
        return base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadSignatureError(f"signature is not valid base64 ({exc})", job_id=job_id) from exc


def check_signature(
    text: str,
    key_id: str | None,
    signature: str | None,
    *,
    trusted: Mapping[str, Ed25519PublicKey],
    require_signature: bool,
    job_id: str | None,
) -> None:
    """Raise unless ``signature`` (base64) is ``key_id``'s over ``text``, ``key_id`` one of ``trusted``.

    No signature passes only when ``require_signature`` is false. Raises :class:`UnsignedError`,
    :class:`UnknownKeyError` or :class:`BadSignatureError` carrying ``job_id``.
    """
    if signature is None:
        if require_signature:
            raise UnsignedError(
                "manifest is not signed and delivery.require_signature is true; sign it with "
                "`edge-agent fleet deploy --key KEY`",
                job_id=job_id,
            )
        return
    if key_id is None or key_id not in trusted:
        known = ", ".join(sorted(trusted)) or "none"
        raise UnknownKeyError(
            f"manifest is signed with key id {key_id!r}, which this device does not trust "
            f"(trusted: {known}); add its public key to delivery.trusted_keys or sign with a trusted key",
            job_id=job_id,
        )
    raw = decode_signature(signature, job_id)
    if not verify(trusted[key_id], text.encode("utf-8"), raw):
        raise BadSignatureError(
            f"signature does not match the manifest for key id {key_id!r}: the manifest was "
            "altered after signing, or signed with another key",
            job_id=job_id,
        )
