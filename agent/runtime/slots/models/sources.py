"""What a slot loads, as a :class:`~agent.runtime.slots.loaded.ModelSource`: from the slot's config, from a
model recorded in state.json (and back), from a built engine, or as the interim ONNX model served
while an engine builds.

One job (turning what a slot is asked to run into what it loads), pure but for reading a model
file's hash; the decisions which one to load are in :mod:`agent.runtime.slots.models.choice` and its parts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter

from agent.backends.onnxruntime import interim_providers
from agent.config import SlotConfig
from agent.engines.service import PreparedEngine
from agent.fsutil import sha256_file
from agent.protocol.runs import interim_runs, runs_of
from agent.runtime.slots.loaded import EngineReport, LoadedModel, ModelSource
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.state.file import ModelRecord

#: Why a model was activated, as state.json records it.
Origin = Literal["config", "delivery", "rollback"]
_POSTPROCESS: TypeAdapter[PostprocessSpec] = TypeAdapter(PostprocessSpec)


def model_source(slot: SlotConfig) -> ModelSource:
    """What to load for a configured slot."""
    return ModelSource(
        path=slot.model,
        model_id=slot.model_id or slot.model.stem,
        version=slot.version,
        backend=slot.backend,
        providers=tuple(slot.providers),
        intra_op_threads=slot.intra_op_threads,
        preprocess=slot.preprocess,
        postprocess=slot.postprocess,
        max_batch=slot.max_batch,
        allow_spinning=slot.allow_spinning,
    )


def engine_report(effective: dict[str, Any]) -> EngineReport:
    """What one built engine effectively is, from its build's effective report (pure)."""
    device = str(effective.get("device", "cpu"))
    if device == "dla" and effective.get("dla_core") is not None:
        device = f"dla{effective['dla_core']}"
    placement = effective.get("placement") or {}
    requested = effective.get("engine_device") or (effective.get("requested") or {}).get("device")
    return EngineReport(
        device=device,
        precision=effective.get("precision"),
        dla_layers=placement.get("dla_layers"),
        gpu_layers=placement.get("gpu_layers"),
        requested=str(requested) if requested is not None else None,
    )


def engine_summary(effective: dict[str, Any]) -> dict[str, object]:
    """One engine of a set as job status lists it in ``effective.engines`` (pure)."""
    return {**engine_report(effective).as_dict(), "reason": effective.get("engine_reason")}


def engine_source(base: ModelSource, prepared: PreparedEngine) -> ModelSource:
    """``base`` (the slot's model) as one built engine: its file, backend, load options and report."""
    artifact = prepared.artifact
    return replace(
        base,
        path=artifact.engine_path,
        backend=artifact.backend,
        providers=tuple(artifact.providers),
        extra=tuple(artifact.load_extra.items()),
        engine_key=artifact.key,
        report=engine_report(prepared.effective),
        engines=(),
        runs=runs_of(prepared.effective),
    )


def interim_source(candidate: ModelSource, build: BuildSpec | None = None) -> ModelSource:
    """``candidate``'s ONNX model as it is, on ONNX Runtime with the best provider present: what a
    slot serves while its engine builds. Never ONNX Runtime's TensorRT provider, which would build
    a TensorRT engine of its own before serving its first frame. ``build``: the request of the engine
    that builds meanwhile (its precision is what the slot reports as asked)."""
    return replace(
        candidate,
        backend="onnxruntime",
        providers=interim_providers(),
        extra=(),
        engine_key=None,
        build=None,
        report=None,
        engines=(),
        runs=interim_runs((build or candidate.build or BuildSpec()).precision),
    )


def from_record(configured: ModelSource, record: ModelRecord) -> ModelSource:
    """The slot's configured source, pointed at a model recorded in state.json."""
    preprocess = PreprocessSpec.model_validate(record.preprocess) if record.preprocess else None
    postprocess = _POSTPROCESS.validate_python(record.postprocess) if record.postprocess else None
    return replace(
        configured,
        path=Path(record.path),
        model_id=record.model_id,
        version=record.version,
        backend="onnxruntime" if record.path.endswith(".onnx") else record.backend,
        preprocess=preprocess or configured.preprocess,
        postprocess=postprocess or configured.postprocess,
        sha256=None,
        model_path=None,
        share_engines=record.share_engines,
    )


def record_of(source: ModelSource, loaded: LoadedModel, origin: Origin) -> ModelRecord:
    """How state.json records ``loaded`` (made from ``source``): what :func:`from_record` reads back."""
    return ModelRecord(
        model_id=loaded.ref.model_id,
        version=loaded.ref.version,
        sha256=loaded.ref.sha256,
        path=str(source.model_path or source.path),
        backend=source.backend,
        engine_key=source.engine_key,
        build=source.build.model_dump(mode="json") if source.build is not None else None,
        preprocess=source.preprocess.model_dump(mode="json"),
        postprocess=_POSTPROCESS.dump_python(source.postprocess, mode="json"),  # type: ignore[arg-type]
        origin=origin,
        share_engines=source.share_engines,
    )


def build_of(record: ModelRecord) -> BuildSpec | None:
    """The build request a recorded engine was made with (None: the ONNX model ran as it is)."""
    return BuildSpec.model_validate(record.build) if record.build else None


def needs_frames(build: BuildSpec) -> bool:
    """Whether the build calibrates on live frames (it can only start once the streams run)."""
    return build.calibration is not None and build.calibration.kind == "stream"


def sha_or_none(path: Path) -> str | None:
    """The model file's sha256, None when it cannot be read (missing)."""
    try:
        return sha256_file(path)
    except OSError:
        return None
