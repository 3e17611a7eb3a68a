"""A desired state checked against the fleet root: the root is fresh, the controller's key is the root's
controller key and signed the manifest, and the release it names was signed by the release keys.

The controller's key alone can therefore choose only among released models: a stolen controller key
signs a manifest the device reads, and the release check refuses the bytes nobody released.
"""

from __future__ import annotations

from datetime import datetime

from securesystemslib.exceptions import UnverifiedSignatureError
from securesystemslib.signer import Signature
from tuf.api.metadata import Metadata, Root, Targets

from agent.protocol.delivery_errors import (
    BadSignatureError,
    RevokedKeyError,
    TrustExpiredError,
    UnknownKeyError,
    UnsignedError,
)
from agent.protocol.manifest import DeployManifest, SignedManifest, read_envelope, read_manifest
from agent.protocol.manifest_signature import decode_signature
from agent.trust.release import check_release
from agent.trust.roles import CONTROLLER, revoked_keys


def check_fresh(root: Metadata[Root], now: datetime, job_id: str | None) -> None:
    """Raise ``trust_expired`` once ``root`` has expired: the device then installs nothing new."""
    if root.signed.is_expired(now):
        raise TrustExpiredError(
            f"this device's fleet root (version {root.signed.version}) expired at "
            f"{root.signed.expires.isoformat()}; publish a renewed root (`edge-agent fleet trust rotate`) "
            "and the device takes it over MQTT",
            job_id=job_id,
        )


def check_controller(root: Metadata[Root], envelope: SignedManifest, job_id: str | None) -> None:
    """Raise unless the envelope's signature is by one of ``root``'s controller keys over the manifest
    text. Codes: unsigned, revoked_key, unknown_key, bad_signature."""
    key_id, signature = envelope.key_id, envelope.signature
    if signature is None or key_id is None:
        raise UnsignedError(
            "manifest is not signed and this device has a fleet root; the controller signs every "
            "desired state",
            job_id=job_id,
        )
    if key_id in revoked_keys(root):
        raise RevokedKeyError(
            f"the desired state is signed by revoked controller key {key_id[:16]}; the controller must "
            "sign with its new key",
            job_id=job_id,
        )
    role = root.signed.get_delegated_role(CONTROLLER)
    if key_id not in role.keyids:
        raise UnknownKeyError(
            f"the desired state is signed with key id {key_id!r}, which is not a controller key of this "
            f"device's fleet root (version {root.signed.version}); sign with the controller key",
            job_id=job_id,
        )
    raw = decode_signature(signature, job_id)
    try:
        root.signed.get_key(key_id).verify_signature(
            Signature(key_id, raw.hex()), envelope.manifest.encode("utf-8")
        )
    except UnverifiedSignatureError as exc:
        raise BadSignatureError(
            f"signature does not match the manifest for controller key {key_id[:16]}: the manifest was "
            "altered after signing, or signed with another key",
            job_id=job_id,
        ) from exc


def check_desired(root: Metadata[Root], payload: bytes, device_id: str, now: datetime) -> DeployManifest:
    """The manifest of a ``down/desired/{slot}`` payload, checked against ``root``: fresh root, the
    controller's signature, the manifest's shape, then its release. Raises a RejectedError subclass."""
    return checked_release(root, payload, device_id, now)[0]


def checked_release(
    root: Metadata[Root], payload: bytes, device_id: str, now: datetime
) -> tuple[DeployManifest, Metadata[Targets]]:
    """:func:`check_desired`'s manifest and the release that vouched for it."""
    envelope, job_id = read_envelope(payload)
    check_fresh(root, now, job_id)
    check_controller(root, envelope, job_id)
    manifest = read_manifest(envelope, job_id, device_id)
    return manifest, check_release(root, envelope.release, manifest, now)
