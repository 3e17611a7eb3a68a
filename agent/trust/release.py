"""A model release: TUF targets metadata, signed by the offline release keys, binding one model's bytes, its
artifacts (the INT8 calibration cache) and its pre- and postprocessing together.

The operator makes it once per model (:func:`release_for`); the controller then only names it in a
desired state. The device checks that the manifest it got describes exactly the released bytes and
specs (:func:`check_release`), so nothing can be swapped or mixed with another release's parts.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from tuf.api.metadata import Metadata, Root, TargetFile, Targets

from agent.protocol.delivery_errors import RevokedKeyError, TrustExpiredError, UnreleasedError
from agent.protocol.device_targets import target_kind
from agent.protocol.manifest import DeployManifest
from agent.trust.roles import RELEASE, revoked_keys

MODEL_TARGET = "model"
ARTIFACT_PREFIX = "artifact/"
#: Bytes a release document may take on the wire (a handful of targets and two specs).
MAX_RELEASE_BYTES = 256 * 1024


def _specs(manifest: DeployManifest) -> dict[str, Any]:
    """What the release binds beside the bytes: the model's name and version, its pre/postprocessing,
    and for a device target (configuration, agent release) its kind, so no release of one kind is
    taken for another."""
    specs: dict[str, Any] = {
        "model_id": manifest.model_id,
        "version": manifest.version,
        "preprocess": manifest.preprocess.model_dump(mode="json") if manifest.preprocess else None,
        "postprocess": manifest.postprocess.model_dump(mode="json") if manifest.postprocess else None,
    }
    kind = target_kind(manifest.slot)
    if kind != "model":
        specs["kind"] = kind
    return specs


def _targets(manifest: DeployManifest) -> dict[str, TargetFile]:
    files = {MODEL_TARGET: TargetFile(manifest.size, {"sha256": manifest.sha256}, MODEL_TARGET)}
    for artifact in manifest.artifacts or ():
        path = ARTIFACT_PREFIX + artifact.name
        files[path] = TargetFile(artifact.size, {"sha256": artifact.sha256}, path)
    return files


def release_for(manifest: DeployManifest, *, version: int, expires: datetime) -> Metadata[Targets]:
    """Unsigned release metadata binding ``manifest``'s model, artifacts and specs (sign it with the
    release keys: :meth:`Metadata.sign`)."""
    targets = Targets(version=version, expires=expires, targets=_targets(manifest))
    targets.unrecognized_fields["x-edge-release"] = _specs(manifest)
    return Metadata(targets)


def _read(data: str, job_id: str | None) -> Metadata[Targets]:
    if len(data.encode("utf-8")) > MAX_RELEASE_BYTES:
        raise UnreleasedError(f"release is larger than {MAX_RELEASE_BYTES} bytes", job_id=job_id)
    try:
        release = Metadata[Targets].from_bytes(data.encode("utf-8"))
    except Exception as exc:  # tuf raises DeserializationError with several causes
        raise UnreleasedError(f"release is not TUF targets metadata ({exc})", job_id=job_id) from exc
    if not isinstance(release.signed, Targets):
        raise UnreleasedError(f"release is {release.signed.type} metadata, not targets", job_id=job_id)
    return release


def check_signers(root: Metadata[Root], release: Metadata[Targets], job_id: str | None) -> None:
    """Raise unless a threshold of ``root``'s release keys signed ``release``: ``revoked_key`` when a
    revoked key signed it, ``unreleased`` otherwise."""
    result = root.signed.get_verification_result(RELEASE, release.signed_bytes, release.signatures)
    if result.verified:
        return
    revoked = sorted(revoked_keys(root) & set(release.signatures))
    if revoked:
        raise RevokedKeyError(
            f"release is signed by revoked key {', '.join(k[:16] for k in revoked)}; have it re-signed by a "
            "current release key (`edge-agent fleet trust release`)",
            job_id=job_id,
        )
    raise UnreleasedError(
        f"release is signed by {len(result.signed)} of the {result.threshold} release keys the fleet root "
        "requires; sign the model with the release key (`edge-agent fleet trust release`)",
        job_id=job_id,
    )


def check_release(
    root: Metadata[Root], release_text: str | None, manifest: DeployManifest, now: datetime
) -> Metadata[Targets]:
    """Raise unless ``release_text`` is a release the root's release keys signed, unexpired, binding
    exactly ``manifest``'s model bytes, artifacts and specs. Codes: unreleased, revoked_key, trust_expired."""
    job = manifest.job_id
    if release_text is None:
        raise UnreleasedError(
            "this device has a fleet root and the desired state names no release; deploy a model signed "
            "with the release key (`edge-agent fleet trust release`, then `fleet deploy --release`)",
            job_id=job,
        )
    release = _read(release_text, job)
    check_signers(root, release, job)
    if release.signed.is_expired(now):
        raise TrustExpiredError(
            f"release expired at {release.signed.expires.isoformat()}; re-sign it with the release key",
            job_id=job,
        )
    wanted = {path: (t.length, t.hashes) for path, t in _targets(manifest).items()}
    got = {path: (t.length, t.hashes) for path, t in release.signed.targets.items()}
    if wanted != got:
        raise UnreleasedError(
            f"the desired state's files are not the released ones (released: {sorted(got)}, "
            f"{json.dumps({p: h for p, (_, h) in got.items()})}); deploy the released model and artifacts",
            job_id=job,
        )
    specs = release.signed.unrecognized_fields.get("x-edge-release")
    if specs != _specs(manifest):
        raise UnreleasedError(
            "the desired state's model id, version, preprocess or postprocess differ from the released "
            "ones; deploy them as released",
            job_id=job,
        )
    return release
