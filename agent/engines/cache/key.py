"""The engine cache key, and the sidecar JSON that records what an engine was built from.

An engine is only valid for the exact inputs it was built from: the model bytes (with external
data), the backend and its exact version, the device (GPU name, compute capability, DLA core, L4T
release, CUDA version), the plan fields that change the engine, and the calibration cache. All of
them go into :class:`EngineIdentity`; :func:`engine_cache_key` is the SHA-256 of its canonical JSON
(keys sorted, no whitespace, ASCII, profiles sorted by input), so it is stable across runs, dict
orderings and Python versions.

Each engine directory (``engines/<key>/``) holds ``meta.json`` (:class:`EngineMeta`).
:func:`read_sidecar` returns None for anything unreadable or mismatched, so the caller rebuilds
instead of crashing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import onnx
import structlog
from pydantic import Field, ValidationError

from agent.errors import BuildError
from agent.fsutil import atomic_write_json, sha256_file
from agent.machine.platform import Platform
from agent.model_base import StrictModel
from agent.specs.build import BuildPlan, EngineOptions

log = structlog.get_logger(__name__)

#: Bumped whenever the identity's contents or canonical form change, so old engines are rebuilt.
KEY_SCHEMA = 1

#: Name of the sidecar file inside an engine directory.
SIDECAR_NAME = "meta.json"

_SHA256 = r"^[0-9a-f]{64}$"

ExtraValue = str | int | float | bool | None

#: BuildPlan fields that do not change the engine: why the plan is what it is, and where the
#: calibration comes from (its content is keyed by ``calibration_sha256``). Written out, not derived:
#: any other field a plan has must be an engine option, or ``for_build`` refuses the plan.
PLAN_FIELDS_NOT_IN_KEY = frozenset({"changes", "calibration"})


class EngineIdentity(EngineOptions):
    """Everything an engine depends on. Two builds with equal identities produce interchangeable engines.

    The plan's part is inherited whole from :class:`~agent.specs.build.EngineOptions`; the rest is
    what the plan does not know: the model, the backend's exact version, the device, the calibration.
    """

    key_schema: int = KEY_SCHEMA
    model_sha256: str = Field(pattern=_SHA256, description="model_sha256(): model bytes with external data.")
    backend_version: str = Field(min_length=1, description="trt.__version__ or onnxruntime.__version__.")
    # Device identity.
    gpu_name: str | None = None
    compute_capability: str | None = None
    l4t_release: str | None = Field(default=None, description="Pins the JetPack's DLA compiler and drivers.")
    cuda_version: str | None = None
    machine: str | None = None
    calibration_sha256: str | None = Field(
        default=None, pattern=_SHA256, description="SHA-256 of the calibration cache."
    )
    extra: dict[str, str] = Field(
        default_factory=dict, description="Anything else, e.g. plugin library hashes."
    )

    @classmethod
    def for_build(
        cls,
        *,
        model_sha256: str,
        plan: BuildPlan,
        platform: Platform,
        calibration_sha256: str | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> EngineIdentity:
        """The identity of building ``plan`` for a model on ``platform``."""
        version = platform.tensorrt_version if plan.backend == "tensorrt" else platform.onnxruntime_version
        if not version:
            raise BuildError(f"cannot key an engine: the {plan.backend} version on this device is unknown")
        # Every plan field that shapes the engine, taken whole. A field a BuildPlan (or a subclass)
        # has beyond EngineOptions and the known exceptions would silently share keys: refuse it.
        engine_fields = plan.model_dump(exclude=set(PLAN_FIELDS_NOT_IN_KEY))
        unkeyed = sorted(set(engine_fields) - set(cls.model_fields))
        if unkeyed:
            raise BuildError(
                f"plan field(s) {unkeyed} are not part of the engine key: declare them in "
                "agent.specs.build.EngineOptions, or in PLAN_FIELDS_NOT_IN_KEY if they do not change it"
            )
        return cls(
            model_sha256=model_sha256,
            backend_version=version,
            gpu_name=platform.gpu_name,
            compute_capability=platform.compute_capability,
            l4t_release=platform.l4t_release,
            cuda_version=platform.cuda_runtime,
            machine=platform.machine,
            calibration_sha256=calibration_sha256,
            extra=dict(extra or {}),
            **engine_fields,
        )


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, ASCII only, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
        "ascii"
    )


def engine_cache_key(identity: EngineIdentity) -> str:
    """SHA-256 hex of the identity's canonical JSON."""
    data = identity.model_dump(mode="json")
    # Profiles are per input: their order in the spec does not change the engine.
    data["profiles"] = sorted(data["profiles"], key=lambda p: str(p["input"]))
    return hashlib.sha256(canonical_json(data)).hexdigest()


# --------------------------------------------------------------------------- model hash


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)


def external_data_files(model_path: Path) -> list[str]:
    """Relative locations of the external data files an ONNX model refers to, sorted, unique."""
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:
        raise BuildError(f"cannot read ONNX model {model_path}: {exc}") from exc
    tensors = list(_graph_tensors(model.graph))
    for function in model.functions:
        for node in function.node:
            tensors.extend(_node_tensors(node))
    locations: set[str] = set()
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        relative = PurePosixPath(location.replace("\\", "/"))
        if not location or relative.is_absolute() or ".." in relative.parts:
            raise BuildError(
                f"ONNX model {model_path.name}: tensor {tensor.name!r} has external data location "
                f"{location!r}; it must be a file next to the model"
            )
        locations.add(str(relative))
    return sorted(locations)


def model_sha256(model_path: Path) -> str:
    """SHA-256 identifying an ONNX model with its external data.

    A self-contained model hashes to its file's SHA-256 (the store's content address). A model
    with external data hashes to the SHA-256 of the canonical JSON ``{"model": <file sha>,
    "external_data": {<location>: <sha>}}``, so changing any weight file changes the hash.
    """
    file_hash = sha256_file(model_path)
    locations = external_data_files(model_path)
    if not locations:
        return file_hash
    external: dict[str, str] = {}
    for location in locations:
        path = model_path.parent / location
        if not path.is_file():
            raise BuildError(
                f"ONNX model {model_path.name} refers to external data {location!r}, which is missing; "
                "deliver the weight files with the model"
            )
        external[location] = sha256_file(path)
    return hashlib.sha256(canonical_json({"model": file_hash, "external_data": external})).hexdigest()


def calibration_sha256(data: bytes) -> str:
    """SHA-256 of a calibration cache's bytes (an input of the engine cache key)."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- sidecar


class EngineMeta(StrictModel):
    """The sidecar ``meta.json`` of one cached engine."""

    key: str = Field(pattern=_SHA256)
    identity: EngineIdentity
    engine_file: str = Field(default="engine", description="File name of the engine inside its directory.")
    engine_sha256: str | None = Field(default=None, pattern=_SHA256)
    engine_bytes: int | None = Field(default=None, ge=0)
    created_at: float = Field(description="Unix time the engine was built.")
    build_seconds: float | None = Field(default=None, ge=0)
    plan: BuildPlan | None = Field(
        default=None, description="The effective plan with its requested-vs-effective changes."
    )
    extra: dict[str, ExtraValue] = Field(default_factory=dict, description="Build facts, e.g. layers on DLA.")


def new_engine_meta(
    identity: EngineIdentity,
    *,
    engine_path: Path | None = None,
    build_seconds: float | None = None,
    plan: BuildPlan | None = None,
    extra: Mapping[str, ExtraValue] | None = None,
) -> EngineMeta:
    """Sidecar contents for an engine just built from ``identity`` (hashes the engine file if given)."""
    return EngineMeta(
        key=engine_cache_key(identity),
        identity=identity,
        engine_file=engine_path.name if engine_path is not None else "engine",
        engine_sha256=sha256_file(engine_path) if engine_path is not None else None,
        engine_bytes=engine_path.stat().st_size if engine_path is not None else None,
        created_at=time.time(),
        build_seconds=build_seconds,
        plan=plan,
        extra=dict(extra or {}),
    )


def write_sidecar(directory: Path, meta: EngineMeta) -> Path:
    """Write ``meta`` atomically as ``directory/meta.json``; returns the path.

    Refuses (BuildError) a meta whose key is not the key of its identity: that sidecar could never
    be read back.
    """
    if engine_cache_key(meta.identity) != meta.key:
        raise BuildError("engine sidecar key does not match its identity; compute it with engine_cache_key")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SIDECAR_NAME
    atomic_write_json(path, meta.model_dump(mode="json"))
    return path


def read_sidecar(directory: Path, expected_key: str | None = None) -> EngineMeta | None:
    """The sidecar in ``directory``, or None when it is missing, unreadable, of another schema,
    inconsistent (its key is not its identity's key) or not ``expected_key``. Never raises."""
    path = directory / SIDECAR_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("engine.sidecar.unreadable", path=str(path), error=str(exc))
        return None
    try:
        meta = EngineMeta.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("engine.sidecar.invalid", path=str(path), error=str(exc).splitlines()[0])
        return None
    reason = None
    if meta.identity.key_schema != KEY_SCHEMA:
        reason = f"key schema {meta.identity.key_schema}, this agent uses {KEY_SCHEMA}"
    elif engine_cache_key(meta.identity) != meta.key:
        reason = "key does not match identity"
    elif expected_key is not None and meta.key != expected_key:
        reason = "key is not the expected key"
    if reason is not None:
        log.warning("engine.sidecar.mismatch", path=str(path), reason=reason)
        return None
    return meta
