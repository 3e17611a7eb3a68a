"""The message between the build supervisor and its child: :class:`BuildJob` in, :class:`WorkerResult` out.

Both sides import this module and nothing of each other: the supervisor
(:mod:`agent.engines.building.worker`) sends a job as JSON on the child's stdin; the child
(:mod:`agent.engines.building.worker_child`) runs a builder (:mod:`agent.engines.building.ort`,
:mod:`agent.engines.trt.builder`) and answers with a result.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from agent.model_base import StrictModel
from agent.specs.build import BuildPlan

MIB = 1 << 20

#: The builds the child runs. Any other kind is a test job (see :mod:`agent.engines.building.worker_child`).
BUILD_KINDS = frozenset({"onnxruntime", "tensorrt"})

ExtraValue = str | int | float | bool | None
Progress = Callable[[str], None]


class BuildJob(StrictModel):
    """Everything the child needs to build one engine; sent as JSON on its stdin."""

    kind: str = Field(
        pattern=r"^[a-z][a-z0-9_]*$",
        description="onnxruntime or tensorrt; any other name is a test job, refused outside tests.",
    )
    model: Path = Field(description="The ONNX model to build from.")
    out_dir: Path = Field(description="Where the child writes the engine and its other files.")
    plan: BuildPlan
    engine_file: str = Field("engine", description="File name of the engine inside out_dir.")
    calibration_dir: Path | None = Field(None, description="Calibration batches as .npy files (sorted).")
    calibration_cache: Path | None = Field(
        None, description="TensorRT calibration cache: read if present, written after calibrating."
    )
    calibration_table: Path | None = Field(
        None,
        description="ONNX Runtime INT8: the operator's calibration (a table or a TensorRT cache) to quantize "
        "with instead of calibrating on frames.",
    )
    timing_cache: Path | None = Field(None, description="TensorRT timing cache of this device.")
    trt_cache_version: str = Field(
        "10.3.0", description="TensorRT version whose header an ONNX Runtime calibration is converted for."
    )
    available_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    model_sha256: str | None = Field(None, description="The model's hash: the slimmed model's cache name.")
    slim_cache_dir: Path | None = Field(
        None, description="Where slimmed models are cached (the plan's slim field says whether to slim)."
    )
    memory_mb: int = Field(0, ge=0, description="Memory limit of the child (0 = none).")
    memory_limit: Literal["as", "data"] = "as"


class WorkerResult(StrictModel):
    """What the child built: files in ``out_dir`` plus facts for the sidecar and the job status."""

    engine_file: str
    files: tuple[str, ...] = Field(default=(), description="Other files in out_dir to cache with the engine.")
    extra: dict[str, ExtraValue] = Field(default_factory=dict, description="Scalars for the sidecar.")
    report: dict[str, Any] = Field(default_factory=dict, description="Effective providers, placement, ...")
    build_seconds: float = 0.0


def memory_hint(memory_mb: int) -> str:
    """The sentence an out-of-memory error gets when the build ran under a limit (else empty)."""
    if memory_mb <= 0:
        return ""
    return f" (the build is limited to {memory_mb} MB: raise engines.build_memory_mb if it needs more)"
