"""What an operator asks to build (``BuildSpec``) and what the planner decided (``BuildPlan``).

The planner (:mod:`agent.engines.building.plan`) maps a spec onto a platform and records a reason for every
change, so the job status can publish requested vs effective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from agent.model_base import StrictModel

Precision = Literal["fp32", "fp16", "int8", "best"]
DeviceTarget = Literal["auto", "gpu", "dla0", "dla1", "cpu"]
#: One engine's device in ``build.devices`` (a slot on several devices at once).
EngineDevice = Literal["gpu", "dla0", "dla1", "cpu"]
#: Most engines one slot runs at once (an AGX Orin has three devices; CPU sessions may repeat).
MAX_ENGINES = 8


class ShapeProfile(StrictModel):
    """min/opt/max shape of one dynamic input (TensorRT optimisation profile)."""

    input: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    @model_validator(mode="after")
    def _ordered(self) -> ShapeProfile:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"profile for {self.input!r}: min, opt and max must have the same rank")
        if any(not (a <= b <= c) for a, b, c in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError(f"profile for {self.input!r}: need min <= opt <= max in every dimension")
        return self

    @property
    def is_static(self) -> bool:
        return self.min == self.opt == self.max


class CalibrationSource(StrictModel):
    """Where INT8 scales come from: an existing cache file, live frames, or a directory of images."""

    kind: Literal["cache", "stream", "dataset"]
    path: Path | None = Field(None, description="Cache file (kind=cache) or image directory (kind=dataset).")
    artifact: str | None = Field(
        None,
        description="kind=cache only: the name of the manifest artifact that carries the calibration (a "
        "calibration table or a TensorRT calibration cache); the device fetches and verifies it like the "
        "model and builds from it instead of calibrating.",
    )
    stream: str | None = Field(
        None, description="Stream to take frames from (kind=stream; default: the slot's)."
    )
    frames: int = Field(200, ge=1, le=100_000, description="Frames to calibrate on (stream/dataset).")

    @model_validator(mode="after")
    def _complete(self) -> CalibrationSource:
        if self.kind == "dataset" and self.path is None:
            raise ValueError("calibration kind 'dataset' needs a path")
        if self.kind == "cache" and (self.path is None) == (self.artifact is None):
            raise ValueError("calibration kind 'cache' needs a path or an artifact (one of them)")
        if self.kind != "cache" and self.artifact is not None:
            raise ValueError(f"calibration kind {self.kind!r} takes no artifact (only kind 'cache' does)")
        return self


class BuildSpec(StrictModel):
    """A build request: precision, target device and limits. Validated once, mapped by each backend."""

    precision: Precision = Field("fp16", description="fp32|fp16|int8|best (best: fastest the device allows).")
    device: DeviceTarget = Field("auto", description="auto|gpu|dla0|dla1|cpu.")
    devices: list[EngineDevice] | Literal["auto"] | None = Field(
        None,
        description="Run the slot on several devices at once, one engine per entry (e.g. [dla0, dla1, gpu]; "
        "auto: every usable one); each inference worker owns one engine. Unset: one engine on 'device'.",
    )
    gpu_fallback: bool = Field(True, description="Let layers the DLA cannot run fall back to the GPU.")
    workspace_mb: int = Field(1024, ge=16, description="TensorRT workspace memory pool limit.")
    dla_sram_mb: int | None = Field(None, ge=0, description="DLA managed SRAM pool limit.")
    dla_local_dram_mb: int | None = Field(None, ge=0, description="DLA local DRAM pool limit.")
    dla_global_dram_mb: int | None = Field(None, ge=0, description="DLA global DRAM pool limit.")
    optimization_level: int = Field(3, ge=0, le=5, description="TensorRT builder optimisation level.")
    profiles: list[ShapeProfile] = Field(
        default_factory=list, description="Shape profiles of dynamic inputs."
    )
    calibration: CalibrationSource | None = Field(None, description="INT8 calibration source.")
    ep_context: Literal["embed", "file", "off"] = Field(
        "embed",
        description="ONNX Runtime's TensorRT provider: dump an EP-context model so a later load skips the "
        "engine build (embed: engine inside the model; file: beside it; off).",
    )
    trt_context_memory_sharing: bool = Field(
        False, description="ONNX Runtime's TensorRT provider: share execution-context memory between engines."
    )
    trt_auxiliary_streams: int | None = Field(
        None, ge=-1, description="ONNX Runtime's TensorRT provider: auxiliary streams (-1: TensorRT decides)."
    )
    slim: bool = Field(
        True, description="Run onnxslim on the model before the engine build (false: build from it as given)."
    )
    prefer: Literal["throughput", "efficiency"] = Field(
        "throughput",
        description="device auto with several candidates (GPU, DLA cores): keep the fastest engine or set of "
        "engines timed together (throughput), or the fastest DLA engine or DLA pair unless it is more than "
        "engines.placement_dla_max_slowdown times slower than that (efficiency).",
    )
    fallback: Literal["onnxruntime", "none"] = Field(
        "onnxruntime",
        description="When a TensorRT build fails on the device: build the ONNX Runtime engine with the best "
        "provider present (onnxruntime), or fail the job (none).",
    )

    @model_validator(mode="after")
    def _engine_list(self) -> BuildSpec:
        if isinstance(self.devices, list) and not 1 <= len(self.devices) <= MAX_ENGINES:
            raise ValueError(
                f"devices: give 1 to {MAX_ENGINES} devices (e.g. [dla0, dla1, gpu]) or auto, "
                f"not {len(self.devices)}"
            )
        return self

    def for_device(self, device: DeviceTarget) -> BuildSpec:
        """This request narrowed to one engine of a multi-device slot (``device`` set, no ``devices``)."""
        return self.model_copy(update={"device": device, "devices": None})


Backend = Literal["tensorrt", "onnxruntime"]


class PlanChange(StrictModel):
    """One way the plan differs from the request, and why (published as requested vs effective)."""

    field: str
    requested: str
    effective: str
    reason: str


class EngineOptions(StrictModel):
    """The plan's choices that change the engine. The engine cache key takes every one of them.

    :class:`BuildPlan` and :class:`~agent.engines.cache.key.EngineIdentity` both derive from this
    class, so a field added here is planned and keyed at once; one added to BuildPlan alone is
    refused when the key is made (see ``EngineIdentity.for_build``).
    """

    backend: Backend
    precision: Literal["fp32", "fp16", "int8"]
    device: Literal["gpu", "dla", "cpu"]
    dla_core: int | None = None
    gpu_fallback: bool = False
    int8_mode: Literal["none", "calibrator", "qdq"] = "none"
    #: INT8 builds also enable FP16, so layers without an INT8 kernel run FP16, not FP32 (DLA requires it).
    allow_fp16: bool = False
    workspace_mb: int = 1024
    dla_sram_mb: int | None = None
    dla_local_dram_mb: int | None = None
    dla_global_dram_mb: int | None = None
    optimization_level: int = 3
    profiles: list[ShapeProfile] = Field(default_factory=list)
    #: The engine is built from the onnxslim-ed model (ONNX -> OnnxSlim -> engine).
    slim: bool = True
    #: ONNX Runtime's TensorRT provider only (mapped by agent.engines.building.ort): the EP-context
    #: model it dumps, shared context memory, auxiliary streams.
    ep_context: Literal["embed", "file", "off"] = "embed"
    trt_context_memory_sharing: bool = False
    trt_auxiliary_streams: int | None = None


class BuildPlan(EngineOptions):
    """What will actually be built on this platform: the engine options, plus where the INT8 scales
    come from and why the plan differs from the request (neither is part of the engine key)."""

    calibration: CalibrationSource | None = None
    changes: list[PlanChange] = Field(default_factory=list)
