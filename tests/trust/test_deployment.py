"""A desired state checked against the fleet root: a stolen controller key cannot ship unreleased bytes."""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from pathlib import Path

import pytest
from securesystemslib.signer import CryptoSigner
from tuf.api.metadata import Metadata, Root

from agent.protocol.delivery_errors import (
    BadSignatureError,
    RejectedError,
    RevokedKeyError,
    TrustExpiredError,
    UnknownKeyError,
    UnreleasedError,
)
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.specs.postprocess import RawSpec
from agent.trust.deployment import check_desired
from agent.trust.release import release_for
from agent.trust.roles import REVOKED_FIELD
from tests.trust.fleet_keys import FleetKeys, in_days, model_manifest, signer

DEVICE = "cam-1"


def released(manifest: DeployManifest, *signers: CryptoSigner, days: float = 30) -> str:
    release = release_for(manifest, version=1, expires=in_days(days))
    for key in signers:
        release.sign(key, append=True)
    return release.to_bytes().decode("utf-8")


def desired(manifest: DeployManifest, controller: CryptoSigner, release: str | None) -> bytes:
    text = manifest.model_dump_json(exclude_none=True)
    signature = controller.sign(text.encode("utf-8"))
    envelope = SignedManifest(
        manifest=text,
        key_id=controller.public_key.keyid,
        signature=base64.b64encode(bytes.fromhex(signature.signature)).decode("ascii"),
        release=release,
    )
    return envelope.model_dump_json(exclude_none=True).encode("utf-8")


def check(root: Metadata[Root], payload: bytes) -> DeployManifest:
    return check_desired(root, payload, DEVICE, datetime.now(timezone.utc))


def refusal(root: Metadata[Root], payload: bytes) -> RejectedError:
    with pytest.raises(RejectedError) as refused:
        check(root, payload)
    return refused.value


def test_a_released_model_named_by_the_controller_is_accepted(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    got = check(keys.root(), desired(manifest, keys.controller, released(manifest, keys.release)))
    assert got.sha256 == manifest.sha256


def test_the_stolen_controller_key_cannot_ship_a_model_nobody_released(tmp_path: Path) -> None:
    keys = FleetKeys()
    root = keys.root()
    mine = model_manifest(tmp_path, "thief")
    # No release at all, a release the thief signed with the controller key, and a real release of
    # another model attached to the thief's bytes: each is refused.
    assert isinstance(refusal(root, desired(mine, keys.controller, None)), UnreleasedError)
    own = refusal(root, desired(mine, keys.controller, released(mine, keys.controller)))
    assert isinstance(own, UnreleasedError)
    assert "0 of the 1 release keys" in str(own)
    other = model_manifest(tmp_path, "good")
    swapped = refusal(root, desired(mine, keys.controller, released(other, keys.release)))
    assert isinstance(swapped, UnreleasedError)


def test_released_bytes_with_other_postprocessing_are_refused(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    release = released(manifest, keys.release)
    mixed = manifest.model_copy(update={"postprocess": RawSpec()})
    assert isinstance(refusal(keys.root(), desired(mixed, keys.controller, release)), UnreleasedError)


def test_a_controller_key_the_root_does_not_name_is_unknown(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    payload = desired(manifest, signer(), released(manifest, keys.release))
    assert isinstance(refusal(keys.root(), payload), UnknownKeyError)


def test_a_manifest_altered_after_the_controller_signed_it_is_refused(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    payload = desired(manifest, keys.controller, released(manifest, keys.release))
    altered = payload.replace(b'\\"sequence\\":1', b'\\"sequence\\":2')
    assert altered != payload
    assert isinstance(refusal(keys.root(), altered), BadSignatureError)


def test_a_release_by_a_revoked_key_is_refused_as_revoked(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    old_release = keys.release
    payload = desired(manifest, keys.controller, released(manifest, old_release))
    keys.release = signer()
    root = keys.root(2, sign_with=0)
    root.signed.unrecognized_fields[REVOKED_FIELD] = [old_release.public_key.keyid]
    for key in keys.root_keys:
        root.sign(key, append=True)
    assert isinstance(refusal(root, payload), RevokedKeyError)


def test_an_expired_root_or_release_refuses_new_deployments(tmp_path: Path) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    payload = desired(manifest, keys.controller, released(manifest, keys.release))
    assert isinstance(refusal(keys.root(expires=in_days(-1)), payload), TrustExpiredError)
    stale = desired(manifest, keys.controller, released(manifest, keys.release, days=-1))
    assert isinstance(refusal(keys.root(), stale), TrustExpiredError)
