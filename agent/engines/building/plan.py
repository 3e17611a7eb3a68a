"""What to build on this platform: a pure function from a :class:`BuildSpec` and platform facts to a plan.

:func:`plan_build` decides the backend, device, precision, INT8 mode and shape profiles, and records
every way the plan differs from the request as a :class:`PlanChange` with the reason, so job status
can publish requested vs effective. A request that cannot be honoured in any sensible way raises
:class:`~agent.errors.BuildError` telling the operator what to change. The rules, in order, are in
``docs/engines.md``; they come from NVIDIA's TensorRT and DLA documentation (see
``shared/reference/tensorrt.md``) and have not been exercised on a Jetson from this code.

One job (pure planning decisions for one engine, with their reasons): each decision (backend,
device, precision, shapes, INT8 mode) is a small table-like function, and they share the reason
type that makes requested vs effective readable. Which devices a slot builds engines for is
:mod:`agent.engines.placement.devices`; what follows a failed engine is
:mod:`agent.engines.building.fallback`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from agent.errors import BuildError
from agent.model_contract.trt_cache import parse_trt_version
from agent.specs.build import (
    BuildPlan,
    BuildSpec,
    CalibrationSource,
    PlanChange,
    ShapeProfile,
)

if TYPE_CHECKING:
    from agent.machine.platform import Platform

EffectiveBackend = Literal["tensorrt", "onnxruntime"]
EffectiveDevice = Literal["gpu", "dla", "cpu"]
EffectivePrecision = Literal["fp32", "fp16", "int8"]
Int8Mode = Literal["none", "calibrator", "qdq"]
#: ONNX Runtime providers that run on the GPU.
ORT_GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})
ORT_TENSORRT_PROVIDER = "TensorrtExecutionProvider"


@dataclass(frozen=True)
class PlatformFacts:
    """The few platform facts the planner needs; tests build them directly.

    ``tensorrt_version`` is None when TensorRT is absent or unusable; ``dla_cores`` is what
    ``builder.num_DLA_cores`` reported (0 when unknown). ``tensorrt_failure`` is set when a TensorRT
    build of this model already failed here, or its engine failed to load or validate: it names the
    failure, and the planner plans ONNX Runtime with it as the reason
    (:func:`agent.engines.building.fallback.plan_fallback` sets it).
    """

    tensorrt_version: str | None
    dla_cores: int
    has_gpu: bool
    ort_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    tensorrt_failure: str | None = None
    #: Set on a chip that has no DLA at all (Jetson Thor): the reason the planner gives for the GPU.
    no_dla: str | None = None

    @classmethod
    def from_platform(cls, platform: Platform) -> PlatformFacts:
        """Facts from a detected :class:`~agent.machine.platform.Platform`.

        Unusable TensorRT counts as absent.
        """
        trt = platform.backends.get("tensorrt")
        usable = trt.usable if trt is not None else platform.tensorrt_version is not None
        no_dla = (
            f"Jetson {platform.soc_family} ({platform.soc}) has no DLA"
            if platform.soc_has_dla is False
            else None
        )
        return cls(
            tensorrt_version=platform.tensorrt_version if usable else None,
            dla_cores=0 if no_dla else platform.dla_cores or 0,
            has_gpu=platform.has_gpu,
            ort_providers=platform.ort_providers,
            no_dla=no_dla,
        )

    @property
    def ort_gpu(self) -> bool:
        return any(p in ORT_GPU_PROVIDERS for p in self.ort_providers)

    @property
    def trt_major_minor(self) -> tuple[int, int] | None:
        if self.tensorrt_version is None:
            return None
        major, minor, _ = parse_trt_version(self.tensorrt_version)
        return major, minor


def _shape(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def shapes_dynamic(spec: BuildSpec, model_static: bool) -> bool:
    """True when the engine would have dynamic input shapes: a profile with min != max, or a
    model with dynamic inputs and no profile to fix them."""
    return any(not p.is_static for p in spec.profiles) or (not model_static and not spec.profiles)


def usable_dla_cores(facts: PlatformFacts) -> tuple[int, str]:
    """DLA cores TensorRT can use here, and how to explain a shortage."""
    if facts.no_dla is not None:
        return 0, facts.no_dla
    version = facts.tensorrt_version
    major_minor = facts.trt_major_minor
    if major_minor is not None and major_minor[0] == 11 and major_minor[1] < 4:
        return 0, f"TensorRT {version} has no DLA support (absent in TensorRT 11.0-11.3)"
    cores = facts.dla_cores
    return cores, f"this device has {cores} DLA core{'' if cores == 1 else 's'}"


class _Planner:
    """One planning run: the request, the facts, and the changes recorded so far."""

    def __init__(
        self, spec: BuildSpec, facts: PlatformFacts, model_static: bool, model_has_qdq: bool
    ) -> None:
        self.spec = spec
        self.facts = facts
        self.model_static = model_static
        self.model_has_qdq = model_has_qdq
        self.changes: list[PlanChange] = []

    def change(self, field: str, requested: str, effective: str, reason: str) -> None:
        self.changes.append(PlanChange(field=field, requested=requested, effective=effective, reason=reason))

    # -- backend -----------------------------------------------------------------------------

    def backend(self) -> EffectiveBackend:
        facts = self.facts
        if self.spec.device == "cpu":
            self.change("backend", "auto", "onnxruntime", "device cpu: TensorRT runs on GPU or DLA only")
            return "onnxruntime"
        if facts.tensorrt_failure is not None:
            self.change(
                "backend",
                "tensorrt",
                "onnxruntime",
                f"{facts.tensorrt_failure}; fallback: ONNX Runtime with the best provider present",
            )
            return "onnxruntime"
        if facts.tensorrt_version is None:
            self.change("backend", "auto", "onnxruntime", "TensorRT is not installed on this device")
            return "onnxruntime"
        if not facts.has_gpu:
            self.change(
                "backend",
                "auto",
                "onnxruntime",
                f"TensorRT {facts.tensorrt_version} is installed but no CUDA GPU answered",
            )
            return "onnxruntime"
        return "tensorrt"

    # -- device ------------------------------------------------------------------------------

    def trt_device(self) -> tuple[EffectiveDevice, int | None]:
        spec = self.spec
        cores, why_not = usable_dla_cores(self.facts)
        if spec.device == "gpu":
            return "gpu", None
        if spec.device == "auto":
            if cores == 0:
                self.change("device", "auto", "gpu", f"no usable DLA core: {why_not}")
                return "gpu", None
            if spec.precision == "fp32":
                self.change("device", "auto", "gpu", "precision fp32: DLA runs FP16 or INT8 only")
                return "gpu", None
            if shapes_dynamic(spec, self.model_static):
                self.change(
                    "device",
                    "auto",
                    "gpu",
                    "dynamic input shapes and DLA needs static shapes; give profiles with "
                    "min = opt = max to use the DLA",
                )
                return "gpu", None
            self.change("device", "auto", "dla0", f"{why_not}; precision {spec.precision} runs on the DLA")
            return "dla", 0
        # dla0 / dla1
        core = int(spec.device[3:])
        if core >= cores:
            self.change("device", spec.device, "gpu", f"{spec.device} requested but {why_not}")
            return "gpu", None
        return "dla", core

    def ort_device(self) -> EffectiveDevice:
        spec = self.spec
        providers = ", ".join(self.facts.ort_providers) or "none"
        if spec.device == "cpu":
            return "cpu"
        effective: EffectiveDevice = "gpu" if self.facts.ort_gpu else "cpu"
        if spec.device == "auto":
            reason = (
                f"ONNX Runtime with a GPU provider ({providers})"
                if effective == "gpu"
                else f"ONNX Runtime has no CUDA or TensorRT provider here ({providers})"
            )
            self.change("device", "auto", effective, reason)
        elif spec.device == "gpu":
            if effective == "cpu":
                self.change(
                    "device",
                    "gpu",
                    "cpu",
                    f"ONNX Runtime has no CUDA or TensorRT provider here ({providers})",
                )
        else:
            fallback = "its GPU provider" if effective == "gpu" else f"the CPU (no GPU provider: {providers})"
            self.change(
                "device",
                spec.device,
                effective,
                f"{spec.device} needs the TensorRT backend, which is unavailable; "
                f"ONNX Runtime runs on {fallback}",
            )
        return effective

    # -- precision ---------------------------------------------------------------------------

    def precision(self, backend: EffectiveBackend, device: EffectiveDevice) -> EffectivePrecision:
        requested = self.spec.precision
        calibrated = self.spec.calibration is not None
        # ONNX Runtime converts to FP16 only through its TensorRT provider; the CUDA and CPU
        # providers run the model's own (FP32) types.
        ort_no_fp16 = backend == "onnxruntime" and (
            device == "cpu" or ORT_TENSORRT_PROVIDER not in self.facts.ort_providers
        )
        if requested == "best":
            if self.model_has_qdq:
                self.change("precision", "best", "int8", "best: the model carries Q/DQ (INT8) scales")
                return "int8"
            if calibrated:
                self.change("precision", "best", "int8", "best: an INT8 calibration source is given")
                return "int8"
            if ort_no_fp16:
                where = "the CPU" if device == "cpu" else "ONNX Runtime's CUDA provider"
                self.change("precision", "best", "fp32", f"best without INT8 calibration on {where}: FP32")
                return "fp32"
            self.change(
                "precision", "best", "fp16", f"best without INT8 calibration or Q/DQ on the {device}: FP16"
            )
            return "fp16"
        if requested == "fp32" and device == "dla":
            self.change("precision", "fp32", "fp16", "DLA runs FP16 or INT8 only, never FP32")
            return "fp16"
        if requested == "fp16" and ort_no_fp16:
            where = (
                "on the CPU"
                if device == "cpu"
                else "with the CUDA provider (FP16 needs the TensorRT provider)"
            )
            self.change("precision", "fp16", "fp32", f"ONNX Runtime runs FP32 {where}")
            return "fp32"
        return requested

    # -- shapes ------------------------------------------------------------------------------

    def profiles(self, device: EffectiveDevice) -> list[ShapeProfile]:
        spec = self.spec
        if device != "dla" or not shapes_dynamic(spec, self.model_static):
            return list(spec.profiles)
        if not spec.profiles:
            raise BuildError(
                "DLA needs static input shapes, but the model has dynamic inputs and the build spec gives no "
                "shape profile: add a static profile (min = opt = max) for each dynamic input, or build for "
                "device gpu"
            )
        pinned: list[ShapeProfile] = []
        for profile in spec.profiles:
            if profile.is_static:
                pinned.append(profile)
                continue
            pinned.append(
                ShapeProfile(input=profile.input, min=profile.opt, opt=profile.opt, max=profile.opt)
            )
            self.change(
                f"profiles.{profile.input}",
                f"min={_shape(profile.min)} opt={_shape(profile.opt)} max={_shape(profile.max)}",
                _shape(profile.opt),
                "DLA needs static shapes: pinned to the profile's opt shape",
            )
        return pinned

    # -- INT8 --------------------------------------------------------------------------------

    def int8(
        self, backend: EffectiveBackend, precision: EffectivePrecision
    ) -> tuple[Int8Mode, CalibrationSource | None]:
        calibration = self.spec.calibration
        if precision != "int8":
            if calibration is not None:
                self.change(
                    "calibration",
                    calibration.kind,
                    "none",
                    f"precision {precision}: INT8 calibration is unused",
                )
            return "none", None
        if self.model_has_qdq:
            if calibration is not None:
                self.change(
                    "calibration",
                    calibration.kind,
                    "none",
                    "the model carries Q/DQ scales; a calibration table must never be combined with Q/DQ",
                )
            return "qdq", None
        if backend == "onnxruntime":
            # ONNX Runtime's quantize_static turns the calibration source into a Q/DQ model.
            return "qdq", calibration
        major_minor = self.facts.trt_major_minor
        if major_minor is not None and major_minor[0] >= 11:
            self.change(
                "int8_mode",
                "calibrator",
                "qdq",
                f"TensorRT {self.facts.tensorrt_version} has no implicit INT8 calibrators (removed in 11): "
                "the model is quantized to Q/DQ from the calibration source before the build",
            )
            return "qdq", calibration
        return "calibrator", calibration


def plan_build(
    spec: BuildSpec, facts: PlatformFacts, *, model_static: bool, model_has_qdq: bool = False
) -> BuildPlan:
    """Decide what to build for ``spec`` on a platform with ``facts``.

    ``model_static``: every model input has a fixed shape. ``model_has_qdq``: the model carries
    QuantizeLinear/DequantizeLinear nodes (explicit INT8). Raises BuildError when the request cannot
    be built: INT8 without any source of scales, or dynamic shapes on the DLA without a profile.
    """
    if spec.precision == "int8" and spec.calibration is None and not model_has_qdq:
        raise BuildError(
            "INT8 needs a calibration cache, stream or dataset, or a Q/DQ model: add 'calibration' to the "
            "build spec, deploy a quantized (Q/DQ) model, or choose precision fp16 or best"
        )
    planner = _Planner(spec, facts, model_static, model_has_qdq)
    backend = planner.backend()
    dla_core: int | None = None
    if backend == "tensorrt":
        device, dla_core = planner.trt_device()
    else:
        device = planner.ort_device()
    precision = planner.precision(backend, device)
    profiles = planner.profiles(device)
    int8_mode, calibration = planner.int8(backend, precision)
    on_dla = device == "dla"
    ort_trt = backend == "onnxruntime" and device == "gpu" and ORT_TENSORRT_PROVIDER in facts.ort_providers
    return BuildPlan(
        backend=backend,
        precision=precision,
        device=device,
        dla_core=dla_core,
        gpu_fallback=spec.gpu_fallback if on_dla else False,
        int8_mode=int8_mode,
        # DLA needs FP16 enabled next to INT8: layers without an INT8 DLA kernel run FP16 there.
        allow_fp16=on_dla and precision == "int8",
        workspace_mb=spec.workspace_mb,
        dla_sram_mb=spec.dla_sram_mb if on_dla else None,
        dla_local_dram_mb=spec.dla_local_dram_mb if on_dla else None,
        dla_global_dram_mb=spec.dla_global_dram_mb if on_dla else None,
        optimization_level=spec.optimization_level,
        profiles=profiles,
        slim=spec.slim,
        # Options of ONNX Runtime's TensorRT provider: they matter only where that provider builds,
        # so elsewhere they take their defaults and do not split the engine key.
        ep_context=spec.ep_context if ort_trt else "off",
        trt_context_memory_sharing=spec.trt_context_memory_sharing if ort_trt else False,
        trt_auxiliary_streams=spec.trt_auxiliary_streams if ort_trt else None,
        calibration=calibration,
        changes=planner.changes,
    )
