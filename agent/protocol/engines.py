"""Engines shared through the fleet: what a device and the controller say about a cached engine.

The controller keeps a second level of the devices' engine caches, keyed by the same engine cache
key (docs/engines.md, "Engines for the whole fleet"). A device asks for a key on a local miss
(:class:`EngineAsk`), offers an engine it built once it ran to ACTIVE through shadow and probation
(:class:`EngineOffer`, then its files in pieces), and says when a shared engine failed it
(:class:`EngineDrop`). Every request goes on ``{prefix}/{device}/up/engines/{verb}`` with an MQTT 5
response topic ``{prefix}/{device}/down/engines/reply`` and correlation data, and is answered with a
:class:`~agent.protocol.messages.CommandReply` (docs/protocol.md).

What a device may download is a :class:`SignedEngine`: the record's exact JSON bytes, signed by the
controller with the operator's key, as a deploy manifest is. Everything here is bounded: a device's
words are kept by the controller.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent.model_base import StrictModel
from agent.protocol.messages import Count, FiniteTime

_SHA256 = r"^[0-9a-f]{64}$"
#: Most files one engine entry holds (engine, build report, calibration table, a TensorRT cache ...).
MAX_ENGINE_FILES = 16
#: Chunk sizes the device may pull an engine file in (the manifest's bounds).
MIN_ENGINE_CHUNK = 4096
MAX_ENGINE_CHUNK = 1024 * 1024
#: The largest engine file shared (a YOLO-class TensorRT engine is tens of megabytes).
MAX_ENGINE_FILE_BYTES = 2 * 1024**3
#: Longest free text a device sends (a reason, a build fingerprint).
MAX_TEXT = 300
#: Largest sidecar (the engine's meta.json) a record carries.
MAX_META_CHARS = 64 * 1024

#: Longest model name or version a device names an engine's model by (as the manifest bounds them).
MAX_MODEL_TEXT = 128
#: The precisions an engine is built at (the plan's, in the engine's identity).
EnginePrecision = Literal["fp32", "fp16", "int8"]

#: The verbs of ``up/engines/{verb}``.
EngineVerb = Literal["ask", "offer", "piece", "drop", "claim"]
ENGINE_VERBS: tuple[str, ...] = ("ask", "offer", "piece", "drop", "claim")


def _plain_name(value: str) -> str:
    if not value or "/" in value or "\\" in value or value in (".", "..") or value.startswith("."):
        raise ValueError(f"engine file name {value!r} must be a plain file name")
    return value


class EngineFile(StrictModel):
    """One file of an engine entry, described as a manifest describes a model: pulled in chunks."""

    name: str = Field(max_length=128, description="File name inside the engine's cache entry.")
    size: int = Field(gt=0, le=MAX_ENGINE_FILE_BYTES, description="Bytes.")
    sha256: str = Field(pattern=_SHA256, description="SHA-256 of the whole file.")
    chunk_size: int = Field(ge=MIN_ENGINE_CHUNK, le=MAX_ENGINE_CHUNK, description="Bytes per chunk.")
    chunks: list[str] = Field(
        max_length=MAX_ENGINE_FILE_BYTES // MIN_ENGINE_CHUNK, description="Chunk SHA-256s."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _plain_name(value)

    @model_validator(mode="after")
    def _chunk_count(self) -> EngineFile:
        expected = -(-self.size // self.chunk_size)
        if len(self.chunks) != expected:
            raise ValueError(f"chunks has {len(self.chunks)} hashes, size/chunk_size needs {expected}")
        return self


class EngineRecord(StrictModel):
    """What the controller vouches for: an engine entry, who built it, and its files."""

    key: str = Field(pattern=_SHA256, description="The engine cache key (docs/engines.md).")
    fingerprint: str = Field(max_length=MAX_TEXT, description="Backend, version and device it was built for.")
    meta: dict[str, Any] = Field(description="The entry's sidecar (EngineMeta JSON) as the builder wrote it.")
    files: list[EngineFile] = Field(min_length=1, max_length=MAX_ENGINE_FILES)
    built_by: str = Field(max_length=200, description="Device id of the builder.")
    built_at: FiniteTime = Field(description="When the builder stored it, Unix seconds.")
    build_seconds: FiniteTime | None = Field(None, ge=0, description="How long its build took there.")
    job_id: str = Field(max_length=200, description="The builder's job that ran it to ACTIVE.")
    vouched_at: FiniteTime = Field(description="When the controller signed it.")

    @model_validator(mode="after")
    def _distinct(self) -> EngineRecord:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError(f"engine file names repeat: {names}")
        return self


class SignedEngine(StrictModel):
    """An :class:`EngineRecord`'s exact JSON, signed with the operator's key by the controller."""

    record: str = Field(max_length=2 * MAX_META_CHARS, description="The EngineRecord JSON that was signed.")
    key_id: str = Field(max_length=200, description="Id of the signing key (a key of delivery.trusted_keys).")
    signature: str = Field(
        max_length=200, description="Base64 Ed25519 signature of the record's UTF-8 bytes."
    )


class EngineAsk(StrictModel):
    """``up/engines/ask``: does the fleet hold this engine? If nobody holds or builds it, the asker
    is told to build it (a claim on the key); if another device builds it, to wait."""

    key: str = Field(pattern=_SHA256)
    job_id: str | None = Field(
        None, max_length=200, description="The deployment that wants it (a start-up build: its start-up job)."
    )
    fingerprint: str | None = Field(
        None, max_length=MAX_TEXT, description="The platform it is for (shown with a claim)."
    )
    model_id: str | None = Field(
        None, max_length=MAX_MODEL_TEXT, description="The model the job deploys (shown with a claim)."
    )
    version: str | None = Field(
        None, max_length=MAX_MODEL_TEXT, description="The model version the job deploys (shown with a claim)."
    )
    precision: EnginePrecision | None = Field(
        None, description="The engine's precision (shown with a claim)."
    )


class EngineClaim(StrictModel):
    """``up/engines/claim``: the device that was told to build ``key`` is still at it (``renew``,
    its heartbeat) or gave up without an engine to offer (``release``: the next asker builds)."""

    key: str = Field(pattern=_SHA256)
    action: Literal["renew", "release"]
    reason: str = Field("", max_length=MAX_TEXT, description="Why it gave up (release).")


class EngineOffer(StrictModel):
    """``up/engines/offer``: an engine this device built and ran to ACTIVE through shadow and probation."""

    key: str = Field(pattern=_SHA256)
    fingerprint: str = Field(max_length=MAX_TEXT)
    meta: dict[str, Any]
    files: list[EngineFile] = Field(min_length=1, max_length=MAX_ENGINE_FILES)
    built_at: FiniteTime
    build_seconds: FiniteTime | None = Field(None, ge=0)
    job_id: str = Field(min_length=1, max_length=200, description="The job that ran it to ACTIVE.")
    model_id: str | None = Field(
        None, max_length=MAX_MODEL_TEXT, description="The model that job deployed (`fleet engines list`)."
    )
    version: str | None = Field(
        None,
        max_length=MAX_MODEL_TEXT,
        description="The model version that job deployed (`fleet engines list`).",
    )
    shadow: bool = Field(description="The job ran a shadow comparison before the swap.")
    probation_s: FiniteTime = Field(ge=0, description="The probation the job passed, seconds.")

    @model_validator(mode="after")
    def _bounded(self) -> EngineOffer:
        # The controller keeps the sidecar in its index and signs it into the record: bounded here.
        size = len(json.dumps(self.meta))
        if size > MAX_META_CHARS:
            raise ValueError(f"meta is {size} characters of JSON, more than {MAX_META_CHARS}")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError(f"engine file names repeat: {names}")
        return self


#: Where a shared engine failed on a device (``up/engines/drop``).
DropStage = Literal["verify", "load", "agreement"]


class EngineDrop(StrictModel):
    """``up/engines/drop``: a shared engine failed on this device (refused, or failed to load/validate)."""

    key: str = Field(pattern=_SHA256)
    engine_sha256: str | None = Field(None, pattern=_SHA256, description="The engine file it downloaded.")
    stage: DropStage = Field(
        description="verify: refused before use; load: load/validate; agreement: an INT8 engine below "
        "the device's accuracy bar on its own frames."
    )
    reason: str = Field(max_length=MAX_TEXT)


class ClaimListed(StrictModel):
    """A live build claim in ``fleet engines list`` (the device building a key nobody holds yet)."""

    key: str
    fingerprint: str
    device: str
    job_id: str | None = None
    since: FiniteTime = Field(description="When the device was told to build it, Unix seconds.")
    heard_s: FiniteTime = Field(description="Seconds since the builder was last heard.")
    waiting: Count = Field(description="Devices waiting for this engine.")
    model_id: str | None = Field(None, description="The model the builder's job deploys, as it said.")
    version: str | None = Field(None, description="That model's version, as the builder said.")
    precision: str | None = Field(None, description="The engine's precision, as the builder said.")


class EngineListed(StrictModel):
    """One row of ``fleet engines list`` (the controller's ``engines`` verb)."""

    key: str
    fingerprint: str
    bytes: Count
    built_by: str
    built_at: FiniteTime
    build_seconds: FiniteTime | None = None
    reuse: Count = Field(description="Downloads by other devices.")
    last_used: FiniteTime
    model_id: str | None = Field(None, description="The model its builder's job deployed, as it said.")
    version: str | None = Field(None, description="That model's version, as its builder said.")
    precision: str | None = Field(None, description="The precision it was built at (its identity's).")


__all__ = [
    "ENGINE_VERBS",
    "ClaimListed",
    "EngineAsk",
    "EngineClaim",
    "EngineDrop",
    "EngineFile",
    "EngineListed",
    "EngineOffer",
    "EngineRecord",
    "EngineVerb",
    "SignedEngine",
]
