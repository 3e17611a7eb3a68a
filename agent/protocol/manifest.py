"""The deploy manifest: what the operator wants in a slot, signed, retained on ``down/desired/{slot}``.

Wire format (``SignedManifest``): ``{"manifest": "<manifest JSON as a string>", "key_id": ...,
"signature": "<base64>"}``. The manifest travels as a string so the Ed25519 signature covers its
exact UTF-8 bytes: nothing is re-serialised before verification, so key order or float formatting
can never break a signature. :func:`parse_signed` checks in this order: JSON, envelope shape,
signature, manifest shape and names, target device. Every refusal is a :class:`RejectedError`
subclass with a stable ``code``.

One job, the manifest's wire format in both directions: its models, made from files and signed on
the operator side, checked and parsed on the device. The checks it relies on have their own
modules: names and hashes (:mod:`agent.protocol.manifest_names`), the signature
(:mod:`agent.protocol.manifest_signature`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic_core import PydanticCustomError

from agent.fsutil import hash_chunks
from agent.model_base import StrictModel
from agent.names import NAME_PATTERN
from agent.protocol.delivery_errors import (
    BadJsonError,
    BadManifestError,
    BadNameError,
    RejectedError,
    WrongDeviceError,
)
from agent.protocol.device_targets import AGENT_TARGET, DEVICE_TARGETS, MAX_RELEASE_WHEELS
from agent.protocol.manifest_names import (
    SHA256_PATTERN,
    bad_name,
    check_chunk_count,
    check_chunk_hashes,
    check_job_id,
    check_path_safe,
)
from agent.protocol.manifest_signature import check_signature, signature_for
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.signing import Ed25519PrivateKey, Ed25519PublicKey
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

KIB = 1024
MIB = 1024 * KIB
DEFAULT_CHUNK_SIZE = 256 * KIB
MIN_CHUNK_SIZE = 1 * KIB
MAX_CHUNK_SIZE = 1 * MIB


class ModelSourceRef(StrictModel):
    """Where the device can fetch the model bytes; tried in manifest order."""

    kind: Literal["mqtt", "http"] = Field(
        description="mqtt: pull chunks on up/xfer/req; http: GET the url (Range resume)."
    )
    url: str | None = Field(None, description="http(s) URL of the model file (kind=http only).")

    @model_validator(mode="after")
    def _url_matches_kind(self) -> ModelSourceRef:
        if self.kind == "http":
            if not self.url or not self.url.startswith(("http://", "https://")):
                raise ValueError("an http source needs a url starting with http:// or https://")
        elif self.url is not None:
            raise ValueError("an mqtt source takes no url")
        return self


#: Most artifacts one manifest carries (a calibration, labels: a handful at most).
MAX_ARTIFACTS = 8
#: calibration: an INT8 calibration for the build; wheel: one wheel of an agent release (``_agent``).
ArtifactKind = Literal["calibration", "wheel"]


class ManifestArtifact(StrictModel):
    """An extra file a deployment needs beside the model (an INT8 calibration), signed with the manifest.

    Fetched like the model (the chunk server answers by SHA-256 on ``up/xfer/req``, or GET ``url``)
    and verified the same way: every chunk against ``chunks``, the whole file against ``sha256``.
    """

    name: str = Field(description="Name the build request refers to (calibration.artifact).")
    kind: ArtifactKind = Field(
        description="calibration: a calibration table or TensorRT calibration cache the INT8 build uses; "
        "wheel: one wheel of an agent release (target _agent), named by its file name."
    )
    size: int = Field(gt=0, description="File size in bytes.")
    sha256: str = Field(pattern=SHA256_PATTERN, description="SHA-256 (lowercase hex) of the whole file.")
    chunk_size: int = Field(ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE, description="Bytes per chunk.")
    chunks: list[str] = Field(description="SHA-256 (lowercase hex) of every chunk, in order.")
    url: str | None = Field(
        None, description="http(s) URL of the file, tried before the MQTT pull (which stays the fallback)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_path_safe("artifact name", value)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an artifact url must start with http:// or https://")
        return value

    @field_validator("chunks")
    @classmethod
    def _chunk_hashes(cls, value: list[str]) -> list[str]:
        return check_chunk_hashes(value)

    @model_validator(mode="after")
    def _chunk_count(self) -> ManifestArtifact:
        check_chunk_count(self.size, self.chunk_size, self.chunks)
        return self


class DeployManifest(StrictModel):
    """One deployment: which model bytes go into which slot, how to fetch, check and build them."""

    job_id: str = Field(description="Unique id of this deployment; one topic level: [A-Za-z0-9_.-].")
    sequence: int = Field(
        ge=1, description="Increases with every manifest for the slot; older ones are replays."
    )
    device: str | None = Field(None, description="Target device id; another device refuses the manifest.")
    slot: str = Field(description="Model slot to deploy into.")
    model_id: str = Field(description="Model name reported with results.")
    version: str = Field(description="Model version reported with results.")
    size: int = Field(gt=0, description="Model file size in bytes.")
    sha256: str = Field(
        pattern=SHA256_PATTERN, description="SHA-256 (lowercase hex) of the whole model file."
    )
    chunk_size: int = Field(
        ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE, description="Bytes per chunk (the last one may be shorter)."
    )
    chunks: list[str] = Field(description="SHA-256 (lowercase hex) of every chunk, in order.")
    sources: list[ModelSourceRef] = Field(min_length=1, description="Where to fetch the bytes, in order.")
    build: BuildSpec | None = Field(None, description="Engine build request; absent: run the ONNX as is.")
    # Absent by default: a manifest without artifacts is what older agents (extra keys forbidden) accept.
    artifacts: list[ManifestArtifact] | None = Field(
        None,
        # A model takes MAX_ARTIFACTS (checked below); an agent release one wheel per artifact.
        max_length=MAX_RELEASE_WHEELS,
        description="Extra signed files the build needs (an INT8 calibration), fetched and verified like the "
        "model.",
    )

    @field_serializer("shadow", "probation")
    def _spec_with_nulls(self, spec: BaseModel | None) -> dict[str, object] | None:
        # The manifest is signed as ``exclude_none`` JSON, which would also drop a null *inside* these
        # specs: ``min_agreement: null`` (a model whose classes changed) or a disabled probation bar
        # would reach the device as its default instead. Their nulls are the operator's words.
        return None if spec is None else spec.model_dump(mode="json")

    @field_serializer("build")
    def _build_as_set(self, build: BuildSpec | None) -> dict[str, object] | None:
        # Only the keys the operator set: the device applies its own defaults. A key with a default
        # that only newer agents know (slim, fallback, ...) would make an older agent, which refuses
        # unknown keys, reject the whole manifest.
        return None if build is None else build.model_dump(mode="json", exclude_defaults=True)

    preprocess: PreprocessSpec | None = Field(None, description="New preprocess; absent: keep the slot's.")
    postprocess: PostprocessSpec | None = Field(
        None, description="New postprocess (labels inside); absent: keep the slot's."
    )
    created_at: float = Field(
        default_factory=time.time, description="When the manifest was made, Unix seconds."
    )
    shadow: ShadowSpec | None = Field(
        None,
        description="Compare the candidate with the serving model on live frames first; absent: no shadow.",
    )
    # Both absent by default: a manifest without them means what it meant before this feature, and
    # an older agent (extra keys forbidden) still accepts one that does not ask for a probation.
    probation_s: float | None = Field(
        None,
        ge=0.0,
        le=86_400.0,
        description="Seconds the new model serves on probation after the swap; absent or 0 skips it.",
    )
    probation: ProbationSpec | None = Field(
        None, description="The probation's health bars; absent: the defaults (used when probation_s > 0)."
    )
    # Absent by default (older agents refuse unknown keys): the device neither asks the fleet for the
    # engine nor offers its own, as before fleet-shared engines (docs/engines.md).
    share_engines: bool | None = Field(
        None,
        description="Ask the controller for the engine on a cache miss, and offer a build that ran to ACTIVE "
        "through shadow and probation; absent or false: neither.",
    )
    # Absent by default (older agents refuse unknown keys), as for ``share_engines``.
    rollback: bool | None = Field(
        None,
        description="This desired state moves the slot back to a model it served before (a rollout's "
        "rollback): the model it replaces is recorded as rolled back from, never a rollback target; "
        "no shadow or probation (the way back is neither compared with nor returned to that model).",
    )

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, value: str) -> str:
        return check_job_id(value)

    @field_validator("slot")
    @classmethod
    def _slot(cls, value: str) -> str:
        check_path_safe("slot", value)
        if value not in DEVICE_TARGETS and not NAME_PATTERN.match(value):
            raise bad_name(
                "slot",
                value,
                f"is not a slot name (pattern {NAME_PATTERN.pattern}) nor one of {sorted(DEVICE_TARGETS)}",
            )
        return value

    @field_validator("model_id", "version")
    @classmethod
    def _names(cls, value: str, info: Any) -> str:
        return check_path_safe(str(info.field_name), value)

    @field_validator("chunks")
    @classmethod
    def _chunk_hashes(cls, value: list[str]) -> list[str]:
        return check_chunk_hashes(value)

    @model_validator(mode="after")
    def _chunk_count(self) -> DeployManifest:
        check_chunk_count(self.size, self.chunk_size, self.chunks)
        return self

    @model_validator(mode="after")
    def _rollback_unguarded(self) -> DeployManifest:
        if self.rollback and (self.shadow is not None or (self.probation_s or 0.0) > 0.0):
            raise ValueError(
                "rollback: a way back has no shadow and no probation (either would judge it against, "
                "or swap back to, the model being rolled back from); leave both out"
            )
        return self

    @model_validator(mode="after")
    def _artifacts_referenced(self) -> DeployManifest:
        names = [a.name for a in self.artifacts or ()]
        if self.slot != AGENT_TARGET and len(names) > MAX_ARTIFACTS:
            raise ValueError(f"artifacts: at most {MAX_ARTIFACTS} for a model, got {len(names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"artifacts: names must be unique, got {names}")
        calibration = self.build.calibration if self.build is not None else None
        wanted = calibration.artifact if calibration is not None else None
        if wanted is not None:
            kinds = {a.name: a.kind for a in self.artifacts or ()}
            if kinds.get(wanted) != "calibration":
                raise ValueError(
                    f"build.calibration.artifact {wanted!r} names no calibration artifact of this manifest "
                    f"(artifacts: {names or 'none'})"
                )
        return self

    def artifact(self, name: str) -> ManifestArtifact:
        """The artifact called ``name`` (KeyError when the manifest carries none of that name)."""
        for artifact in self.artifacts or ():
            if artifact.name == name:
                return artifact
        raise KeyError(name)

    def for_artifact(self, artifact: ManifestArtifact) -> DeployManifest:
        """This manifest describing ``artifact``'s bytes instead of the model's, for the same fetch path.

        Size, hashes and chunking become the artifact's; the sources are its url (if any), then the
        MQTT pull, which the chunk server answers by SHA-256 as it does for models.
        """
        sources = [ModelSourceRef(kind="http", url=artifact.url)] if artifact.url else []
        sources.append(ModelSourceRef(kind="mqtt"))
        return self.model_copy(
            update={
                "size": artifact.size,
                "sha256": artifact.sha256,
                "chunk_size": artifact.chunk_size,
                "chunks": list(artifact.chunks),
                "sources": sources,
                "artifacts": None,
            }
        )

    @property
    def chunk_count(self) -> int:
        """Number of chunks."""
        return len(self.chunks)

    def chunk_length(self, index: int) -> int:
        """Length in bytes of chunk ``index`` (the last one may be shorter)."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(f"chunk index {index} out of range 0..{len(self.chunks) - 1}")
        return min(self.chunk_size, self.size - index * self.chunk_size)


class SignedManifest(StrictModel):
    """What is published (retained) on ``down/desired/{slot}``."""

    manifest: str = Field(description="The DeployManifest JSON, exactly the bytes that were signed.")
    key_id: str | None = Field(None, description="Id of the signing key (a key of delivery.trusted_keys).")
    signature: str | None = Field(None, description="Base64 Ed25519 signature of the manifest's UTF-8 bytes.")
    # Absent unless the fleet has a root of trust (older agents refuse unknown keys): docs/trust.md.
    release: str | None = Field(
        None,
        max_length=256 * 1024,
        description="The model's release: TUF targets metadata JSON signed by the release keys, binding the "
        "model's bytes, artifacts and pre/postprocessing (docs/trust.md).",
    )


def build_manifest(
    model_path: Path,
    *,
    job_id: str,
    sequence: int,
    slot: str,
    model_id: str,
    version: str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    sources: Sequence[ModelSourceRef] | None = None,
    build: BuildSpec | None = None,
    preprocess: PreprocessSpec | None = None,
    postprocess: PostprocessSpec | None = None,
    device: str | None = None,
    shadow: ShadowSpec | None = None,
    probation_s: float | None = None,
    probation: ProbationSpec | None = None,
    artifacts: Sequence[ManifestArtifact] = (),
    share_engines: bool | None = None,
    rollback: bool | None = None,
) -> DeployManifest:
    """Read ``model_path`` once and describe it: size, SHA-256, per-chunk SHA-256.

    ``sources`` defaults to MQTT pull only. Raises pydantic's ValidationError for invalid values.
    """
    size, whole, chunks = hash_chunks(model_path, chunk_size)
    return DeployManifest(
        job_id=job_id,
        sequence=sequence,
        device=device,
        slot=slot,
        model_id=model_id,
        version=version,
        size=size,
        sha256=whole,
        chunk_size=chunk_size,
        chunks=chunks,
        sources=list(sources) if sources is not None else [ModelSourceRef(kind="mqtt")],
        build=build,
        artifacts=list(artifacts) if artifacts else None,
        preprocess=preprocess,
        postprocess=postprocess,
        shadow=shadow,
        probation_s=probation_s,
        probation=probation,
        share_engines=share_engines or None,
        rollback=rollback or None,
    )


def describe_artifact(
    path: Path, *, name: str, kind: ArtifactKind, chunk_size: int = DEFAULT_CHUNK_SIZE, url: str | None = None
) -> ManifestArtifact:
    """Read ``path`` once and describe it as a manifest artifact (size, SHA-256, per-chunk SHA-256)."""
    size, whole, chunks = hash_chunks(path, chunk_size)
    return ManifestArtifact(
        name=name, kind=kind, size=size, sha256=whole, chunk_size=chunk_size, chunks=chunks, url=url
    )


def sign_manifest(
    manifest: DeployManifest,
    private_key: Ed25519PrivateKey | None,
    key_id: str | None,
    release: str | None = None,
) -> bytes:
    """The SignedManifest JSON to publish; unsigned (no key id, no signature) when ``private_key`` is None.

    ``release``: the model's signed release (docs/trust.md), carried beside the manifest as is.
    """
    text = manifest.model_dump_json(exclude_none=True)
    signature = None
    if private_key is not None:
        signature = signature_for(text, private_key)
    else:
        key_id = None
    envelope = SignedManifest(manifest=text, key_id=key_id, signature=signature, release=release)
    return envelope.model_dump_json(exclude_none=True).encode("utf-8")


def _describe(exc: ValidationError, prefix: str) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        parts.append(f"{path or '(payload)'}: {err['msg']}")
    return "; ".join(parts)


def recover_job_id(payload: bytes) -> str | None:
    """Best effort: the job id a refused payload names, if it is a usable topic level; else None."""
    try:
        outer = json.loads(payload)
        inner = json.loads(outer["manifest"]) if isinstance(outer.get("manifest"), str) else outer
        job_id = inner.get("job_id")
    except (ValueError, TypeError, AttributeError, KeyError):
        return None
    if not isinstance(job_id, str):
        return None
    try:
        check_job_id(job_id)
    except PydanticCustomError:
        return None
    return job_id


def parse_signed(
    payload: bytes,
    trusted: Mapping[str, Ed25519PublicKey],
    require_signature: bool,
    device_id: str,
) -> DeployManifest:
    """Check and parse a ``down/desired/{slot}`` payload; raise a :class:`RejectedError` subclass.

    Codes: bad_json, bad_manifest (with field path), bad_signature, unknown_key, unsigned,
    bad_name, wrong_device. A present signature is always checked, even when not required.
    """
    envelope, job_id = read_envelope(payload)
    check_signature(
        envelope.manifest,
        envelope.key_id,
        envelope.signature,
        trusted=trusted,
        require_signature=require_signature,
        job_id=job_id,
    )
    return read_manifest(envelope, job_id, device_id)


def read_envelope(payload: bytes) -> tuple[SignedManifest, str | None]:
    """The envelope of a ``down/desired/{slot}`` payload and the job id it names, its signature unchecked.

    Codes: bad_json, bad_manifest.
    """
    job_id = recover_job_id(payload)
    try:
        raw = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJsonError(f"desired-state payload is not valid JSON: {exc}", job_id=job_id) from exc
    if not isinstance(raw, dict):
        raise BadManifestError(
            f"desired-state payload must be a JSON object with 'manifest', got {type(raw).__name__}",
            job_id=job_id,
        )
    try:
        return SignedManifest.model_validate(raw), job_id
    except ValidationError as exc:
        raise BadManifestError(f"wrong shape: {_describe(exc, '')}", job_id=job_id) from exc


def read_manifest(envelope: SignedManifest, job_id: str | None, device_id: str) -> DeployManifest:
    """The manifest inside a checked envelope. Codes: bad_json, bad_manifest, bad_name, wrong_device."""
    try:
        body = json.loads(envelope.manifest)
    except ValueError as exc:
        raise BadJsonError(f"manifest string is not valid JSON: {exc}", job_id=job_id) from exc
    try:
        manifest = DeployManifest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        cls: type[RejectedError] = (
            BadNameError if any(e["type"] == "bad_name" for e in errors) else BadManifestError
        )
        raise cls(f"wrong manifest: {_describe(exc, 'manifest')}", job_id=job_id) from exc
    if manifest.device is not None and manifest.device != device_id:
        raise WrongDeviceError(
            f"manifest is for device {manifest.device!r}, this is {device_id!r}; publish it on that "
            "device's topic",
            job_id=manifest.job_id,
        )
    return manifest
