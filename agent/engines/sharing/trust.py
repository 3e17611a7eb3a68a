"""Whether a device takes an engine the fleet offers it: pure checks, each refusal with its reason.

The rules (docs/engines.md, "Trust"): the engine is signed by the controller with a key the
device trusts (the operator's, as for manifests); no signature, an unknown key or a signature that
does not match the record is refused. The signed record must be for the key the device asked for,
and its sidecar's identity must be the one this device computed for the build it was about to
run: an engine for another model, backend version, device, plan or calibration is refused, however
well signed. Only then are its files downloaded, each checked against the signed SHA-256.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from pydantic import ValidationError

from agent.engines.cache.key import SIDECAR_NAME, EngineIdentity, EngineMeta, engine_cache_key
from agent.engines.cache.store import LAST_USED_NAME
from agent.errors import BuildError
from agent.protocol.engines import EngineRecord, SignedEngine
from agent.signing import Ed25519PublicKey, verify


class EngineRefusedError(BuildError):
    """A fleet engine this device will not use; the message says why. The device builds instead."""

    code = "engine_refused"


def verified_record(signed: SignedEngine, trusted: Mapping[str, Ed25519PublicKey]) -> EngineRecord:
    """The record ``signed`` vouches for, after its signature checks out against ``trusted``."""
    if not signed.signature:
        raise EngineRefusedError("the fleet engine is not signed; devices accept no unsigned engine")
    public = trusted.get(signed.key_id)
    if public is None:
        known = ", ".join(sorted(trusted)) or "none"
        raise EngineRefusedError(
            f"the fleet engine is signed with key id {signed.key_id!r}, which this device does not trust "
            f"(trusted: {known})"
        )
    try:
        signature = base64.b64decode(signed.signature, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineRefusedError(f"the fleet engine's signature is not valid base64 ({exc})") from exc
    if not verify(public, signed.record.encode("utf-8"), signature):
        raise EngineRefusedError(
            f"the fleet engine's signature does not match its record for key id {signed.key_id!r}: "
            "altered after signing, or signed with another key"
        )
    try:
        return EngineRecord.model_validate_json(signed.record)
    except ValidationError as exc:
        raise EngineRefusedError(
            f"the fleet engine's record is malformed: {str(exc).splitlines()[0]}"
        ) from exc


def checked_meta(record: EngineRecord, key: str, identity: EngineIdentity) -> EngineMeta:
    """The sidecar to store the engine under ``key`` with, when ``record`` is that engine for this device."""
    if record.key != key:
        raise EngineRefusedError(f"the fleet answered with engine {record.key[:12]} for key {key[:12]}")
    try:
        meta = EngineMeta.model_validate(record.meta)
    except ValidationError as exc:
        raise EngineRefusedError(
            f"the fleet engine's sidecar is malformed: {str(exc).splitlines()[0]}"
        ) from exc
    if meta.key != key or engine_cache_key(meta.identity) != key:
        raise EngineRefusedError("the fleet engine's sidecar is not for the key asked for")
    if meta.identity != identity:
        raise EngineRefusedError(
            "the fleet engine was built for another identity (model, backend version, device, plan or "
            "calibration) than this device's"
        )
    names = {f.name for f in record.files}
    if meta.engine_file not in names:
        raise EngineRefusedError(f"the fleet engine's files lack its engine file {meta.engine_file!r}")
    if names & {SIDECAR_NAME, LAST_USED_NAME}:
        raise EngineRefusedError("the fleet engine's files name the cache's own bookkeeping files")
    engine = next(f for f in record.files if f.name == meta.engine_file)
    if meta.engine_sha256 is not None and meta.engine_sha256 != engine.sha256:
        raise EngineRefusedError(
            "the fleet engine's sidecar and its file list disagree on the engine's SHA-256"
        )
    return meta
