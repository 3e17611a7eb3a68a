"""What follows an engine that failed here: the one place that decides the next step.

An engine fails in one of four ways: its TensorRT build fails (``build``), the TensorRT engine it
built fails to load or validate in the slot (``load``), an INT8 engine fails the accuracy guard,
or an engine downloaded from the fleet fails here. Each ``after_*`` function is pure: given what
failed, the build spec and the failed engine's report, it names the next step (build here on this
device's own frames, rebuild at FP16, the ONNX Runtime fallback, or give up with the reason). The
builder, the engine service and the slot's deployments carry the step out and never decide it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from agent.engines.building.plan import PlatformFacts, plan_build
from agent.protocol.engines import DropStage
from agent.specs.build import BuildPlan, BuildSpec

#: Where TensorRT failed: building the engine, or loading/validating the engine it built.
FailureStage = Literal["build", "load"]
#: What a slot does after a built engine set failed to load or validate (:func:`load_fallback`).
LoadFallback = Literal["onnxruntime", "none", "not_tensorrt"]
#: How the backend change's reason names each failure stage.
FAILED_AT: dict[FailureStage, str] = {
    "build": "the TensorRT build failed",
    "load": "the TensorRT engine built but failed to load or validate",
}

#: ``build_here``: build the engine on this device (its own frames for calibration);
#: ``rebuild_fp16``: build again at FP16 without calibration; ``onnxruntime``: the ONNX Runtime
#: fallback; ``give_up``: the failure stands (``reason`` says why when it adds to the error).
Action = Literal["build_here", "rebuild_fp16", "onnxruntime", "give_up"]


@dataclass(frozen=True)
class NextStep:
    """The decision after a failure: what to do, why, and what to build when something is built.

    ``spec``: the build request of the next build (``build_here``, ``rebuild_fp16``). ``failure``:
    the TensorRT failure the ONNX Runtime fallback names (``onnxruntime``; ``rebuild_fp16`` after a
    load failure, whose rebuild must not plan TensorRT again). ``reason``: for ``give_up``, the
    error to raise instead of the original one; empty when the original error stands as it is.
    """

    action: Action
    reason: str = ""
    spec: BuildSpec | None = None
    failure: str | None = None


def load_fallback(spec: BuildSpec | None, backends: Iterable[str]) -> LoadFallback:
    """What a slot does when a built engine set (its engines' ``backends``) fails to load or validate.

    ``not_tensorrt``: no TensorRT engine failed, so there is nothing to fall back from (the job ends
    ROLLED_BACK as for any bad model); ``none``: the build spec forbids the fallback (same end, naming
    the TensorRT failure); ``onnxruntime``: rebuild on ONNX Runtime (:func:`plan_fallback`, stage
    ``load``) and activate that.
    """
    if spec is None or "tensorrt" not in set(backends):
        return "not_tensorrt"
    return spec.fallback


def plan_fallback(
    spec: BuildSpec,
    facts: PlatformFacts,
    failure: str,
    *,
    model_static: bool,
    model_has_qdq: bool = False,
    stage: FailureStage = "build",
) -> BuildPlan | None:
    """The ONNX Runtime plan to build after a TensorRT build (``stage`` ``build``) or the load or
    validation of a built TensorRT engine (``load``) failed with ``failure``, or None when
    ``spec.fallback`` is ``none`` (the operator wants TensorRT or nothing).

    The plan's changes start with the backend change naming the failure, so the job status says
    why it runs on ONNX Runtime. The device follows ONNX Runtime's providers (TensorRT EP, CUDA, CPU).
    """
    if spec.fallback == "none":
        return None
    failed = replace(facts, tensorrt_failure=f"{FAILED_AT[stage]} ({failure or 'no reason given'})")
    return plan_build(spec, failed, model_static=model_static, model_has_qdq=model_has_qdq)


def fallback_refused(stage: FailureStage, failure: str) -> str:
    """The error when TensorRT failed at ``stage`` and the build spec says ``fallback: none``."""
    return (
        f"{FAILED_AT[stage]} and the build spec says fallback: none, so no ONNX Runtime engine is "
        f"built instead: {failure}"
    )


def after_build_failure(backend: str, failure: str, *, busy: bool, cancelled: bool) -> NextStep:
    """A build of a plan for ``backend`` failed with ``failure``.

    Only a failed TensorRT build falls back: not a busy builder (nothing was tried), not a
    cancelled job. Whether the spec allows the fallback is :func:`plan_fallback`'s to say.
    """
    if backend != "tensorrt" or busy or cancelled:
        return NextStep("give_up")
    return NextStep("onnxruntime", failure=failure)


def after_load_failure(
    spec: BuildSpec | None, backends: Iterable[str], failure: str, *, fleet_engine: bool
) -> NextStep:
    """A built engine set (its engines' ``backends``) failed to load or validate in the slot.

    A fleet engine (``fleet_engine``: downloaded, and now dropped) is built here instead; a TensorRT
    engine falls back to ONNX Runtime unless the spec says ``fallback: none``; anything else is a bad
    model and the failure stands.
    """
    if fleet_engine and spec is not None:
        return NextStep("build_here", spec=spec)
    decision = load_fallback(spec, backends)
    if decision == "not_tensorrt" or spec is None:
        return NextStep("give_up")
    if decision == "none":
        return NextStep("give_up", reason=fallback_refused("load", failure))
    return NextStep("onnxruntime", spec=spec, failure=failure)


def from_fleet(effective: Mapping[str, Any]) -> bool:
    """The engine whose effective report this is was downloaded from the fleet, not built here."""
    source = effective.get("engine_source") or {}
    return bool(source.get("origin") == "downloaded")


def after_int8_check(*, failed: bool, stage: DropStage, fleet_engine: bool) -> NextStep | None:
    """An INT8 engine's guard run ended; ``failed``: it did not load (``stage`` ``load``) or
    disagreed with FP32 (``agreement``). ``fleet_engine``: it was downloaded (and is now dropped).

    A fleet engine that fails is built here, calibrated on this device's own frames: the builder's
    calibration may not fit this camera's scene. An own engine that does not load gives up. None:
    the guard's verdict stands (a rejection is :func:`after_int8_rejected`'s).
    """
    if not failed:
        return None
    if fleet_engine:
        return NextStep("build_here")
    if stage == "load":
        return NextStep("give_up")
    return None


def after_int8_rejected(spec: BuildSpec | None, effective: Mapping[str, Any]) -> NextStep:
    """An INT8 engine (its ``effective`` report) failed the accuracy guard: rebuild at FP16.

    After a load failure the rebuild goes through the ONNX Runtime fallback again (``failure``): a
    plain build would plan TensorRT, whose engine this device already failed to load.
    """
    fp16 = (spec or BuildSpec()).model_copy(update={"precision": "fp16", "calibration": None})
    fallback = effective.get("fallback") or {}
    failure = str(fallback["error"]) if fallback.get("stage") == "load" else None
    return NextStep("rebuild_fp16", spec=fp16, failure=failure)
