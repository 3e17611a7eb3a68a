"""Which devices a slot builds engines for: a ``build.devices`` engine set, and the candidates
``device: auto`` builds and times. Pure functions of a :class:`BuildSpec` and platform facts.

Each engine is then planned on its own by :func:`~agent.engines.building.plan.plan_build` (which records why
a device it got differs from the one asked for); the measured choice among ``device: auto``
candidates is :mod:`agent.engines.placement.choice`.
"""

from __future__ import annotations

from agent.engines.building.plan import PlatformFacts, shapes_dynamic, usable_dla_cores
from agent.specs.build import BuildSpec, DeviceTarget


def placement_candidates(spec: BuildSpec, facts: PlatformFacts, *, model_static: bool) -> tuple[str, ...]:
    """The devices ``device: auto`` builds and times on this platform (placement by measurement).

    TensorRT with a GPU: ``gpu`` plus every usable DLA core, when the precision and shapes allow the
    DLA (FP16/INT8/best, static shapes). Otherwise the single device the planner picks, so there is
    nothing to measure: ONNX Runtime's provider order already decides (TensorRT EP, CUDA, CPU).
    An explicit device is never second-guessed: it is its own only candidate.
    """
    if spec.device != "auto":
        return (spec.device,)
    if facts.tensorrt_version is None or not facts.has_gpu or facts.tensorrt_failure is not None:
        return ("auto",)
    cores, _ = usable_dla_cores(facts)
    if cores == 0 or spec.precision == "fp32" or shapes_dynamic(spec, model_static):
        return ("gpu",)
    return ("gpu", *(f"dla{core}" for core in range(min(cores, 2))))


def engine_devices(
    spec: BuildSpec, facts: PlatformFacts, *, model_static: bool
) -> list[tuple[DeviceTarget, str]]:
    """The devices a slot runs engines on, one engine each, with the reason for each (pure).

    No ``devices``: one engine on ``device`` (its own plan decides where that is). A list: one engine
    per entry, as given (each entry is planned like ``device``, so a ``dla1`` the platform lacks is
    planned onto the GPU or CPU and its plan says why). ``auto``: every usable device: each DLA core
    TensorRT can use for this precision and these shapes, then the GPU (TensorRT, or ONNX Runtime's
    CUDA/TensorRT provider); the CPU alone only when neither is there.
    """
    if spec.devices is None:
        return [(spec.device, f"build.device {spec.device}: one engine")]
    if spec.devices != "auto":
        return [(device, "listed in build.devices") for device in spec.devices]
    chosen: list[tuple[DeviceTarget, str]] = []
    trt = facts.tensorrt_version is not None and facts.has_gpu and facts.tensorrt_failure is None
    if trt:
        cores, why = usable_dla_cores(facts)
        if cores and spec.precision != "fp32" and not shapes_dynamic(spec, model_static):
            # Orin has at most two DLA cores; DeviceTarget names dla0 and dla1 only.
            dlas: tuple[DeviceTarget, ...] = ("dla0", "dla1")
            chosen.extend((dla, f"{why}; TensorRT runs {spec.precision} there") for dla in dlas[:cores])
        chosen.append(("gpu", f"TensorRT {facts.tensorrt_version} on the GPU"))
    elif facts.ort_gpu:
        chosen.append(("gpu", "ONNX Runtime's GPU provider (TensorRT is not usable here)"))
    if not chosen:
        providers = ", ".join(facts.ort_providers) or "none"
        chosen.append(("cpu", f"no GPU or DLA usable here (ONNX Runtime providers: {providers})"))
    return chosen
