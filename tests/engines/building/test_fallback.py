"""What follows an engine that failed: the ONNX Runtime plan, the slot's choice, the next step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from agent.engines.building.fallback import (
    FAILED_AT,
    after_build_failure,
    after_int8_check,
    after_int8_rejected,
    after_load_failure,
    fallback_refused,
    from_fleet,
    load_fallback,
    plan_fallback,
)
from agent.engines.building.plan import PlatformFacts, plan_build
from agent.specs.build import BuildSpec
from tests.engines.building.test_builder_fallback import FORCED_TRT
from tests.engines.building.test_plan import ORIN_AGX, spec


@dataclass(frozen=True)
class FallbackCase:
    """After a failed TensorRT build: the request, the platform, and the ONNX Runtime plan expected."""

    id: str
    facts: PlatformFacts
    spec: dict[str, Any]
    expect: dict[str, Any]


ORIN_WITH_ORT_GPU = PlatformFacts(
    tensorrt_version="10.3.0",
    dla_cores=2,
    has_gpu=True,
    ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
)
ORIN_WITH_ORT_CUDA = PlatformFacts(
    tensorrt_version="10.3.0",
    dla_cores=2,
    has_gpu=True,
    ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
)

FALLBACKS = [
    FallbackCase(
        "gpu-fp16-to-ort-trt-ep",
        ORIN_WITH_ORT_GPU,
        {"device": "gpu", "precision": "fp16"},
        {"backend": "onnxruntime", "device": "gpu", "precision": "fp16"},
    ),
    FallbackCase(
        "dla0-to-ort-cuda-fp32",
        ORIN_WITH_ORT_CUDA,
        {"device": "dla0", "precision": "fp16"},
        {"backend": "onnxruntime", "device": "gpu", "precision": "fp32", "dla_core": None},
    ),
    FallbackCase(
        "auto-to-cpu",
        ORIN_AGX,
        {"device": "auto", "precision": "best"},
        {"backend": "onnxruntime", "device": "cpu", "precision": "fp32"},
    ),
    FallbackCase(
        "int8-calibrated-to-ort-qdq",
        ORIN_WITH_ORT_GPU,
        {"device": "gpu", "precision": "int8", "calibration": {"kind": "stream"}},
        {"backend": "onnxruntime", "device": "gpu", "precision": "int8", "int8_mode": "qdq"},
    ),
]


@pytest.mark.parametrize("case", FALLBACKS, ids=[c.id for c in FALLBACKS])
def test_fallback_plan_after_a_failed_tensorrt_build(case: FallbackCase) -> None:
    requested = BuildSpec.model_validate(case.spec)
    assert plan_build(requested, case.facts, model_static=True).backend == "tensorrt"
    plan = plan_fallback(requested, case.facts, "parser error: Unsupported ONNX op Foo", model_static=True)
    assert plan is not None
    for name, value in case.expect.items():
        assert getattr(plan, name) == value, f"{name}: {getattr(plan, name)!r} != {value!r}"
    first = plan.changes[0]
    assert (first.field, first.requested, first.effective) == ("backend", "tensorrt", "onnxruntime")
    assert "Unsupported ONNX op Foo" in first.reason
    assert all(c.reason for c in plan.changes)


def test_fallback_none_plans_nothing() -> None:
    requested = spec(device="gpu", fallback="none")
    assert plan_fallback(requested, ORIN_WITH_ORT_GPU, "out of memory", model_static=True) is None


def test_load_fallback_decides_by_the_failed_backends_and_the_spec() -> None:
    table = [
        (BuildSpec(device="gpu"), ("tensorrt",), "onnxruntime"),
        (BuildSpec(device="gpu", fallback="none"), ("tensorrt",), "none"),
        (BuildSpec(device="gpu"), ("onnxruntime",), "not_tensorrt"),
        (BuildSpec(device="gpu"), ("onnxruntime", "tensorrt"), "onnxruntime"),
        (None, ("tensorrt",), "not_tensorrt"),
    ]
    for request, backends, decision in table:
        assert load_fallback(request, backends) == decision, (request, backends)


def test_plan_fallback_after_a_load_failure_names_the_load_as_the_reason() -> None:
    facts = PlatformFacts.from_platform(FORCED_TRT)
    spec = BuildSpec(precision="fp16", device="gpu")
    assert plan_build(spec, facts, model_static=True).backend == "tensorrt"
    plan = plan_fallback(spec, facts, "deserializeCudaEngine failed", model_static=True, stage="load")
    assert plan is not None
    assert plan.backend == "onnxruntime"
    first = plan.changes[0]
    assert (first.field, first.requested, first.effective) == ("backend", "tensorrt", "onnxruntime")
    assert first.reason.startswith(f"{FAILED_AT['load']} (deserializeCudaEngine failed)")
    none = spec.model_copy(update={"fallback": "none"})
    assert plan_fallback(none, facts, "x", model_static=True, stage="load") is None


def test_only_a_tried_tensorrt_build_falls_back() -> None:
    step = after_build_failure("tensorrt", "parser error", busy=False, cancelled=False)
    assert (step.action, step.failure) == ("onnxruntime", "parser error")
    for backend, busy, cancelled in [
        ("onnxruntime", False, False),
        ("tensorrt", True, False),
        ("tensorrt", False, True),
    ]:
        step = after_build_failure(backend, "x", busy=busy, cancelled=cancelled)
        assert (step.action, step.reason) == ("give_up", ""), (backend, busy, cancelled)


def test_after_a_load_failure_a_fleet_engine_is_built_here_and_tensorrt_falls_back() -> None:
    gpu = BuildSpec(device="gpu")
    here = after_load_failure(gpu, ("tensorrt",), "bad plan", fleet_engine=True)
    assert (here.action, here.spec) == ("build_here", gpu)
    ort = after_load_failure(gpu, ("tensorrt",), "bad plan", fleet_engine=False)
    assert (ort.action, ort.spec, ort.failure) == ("onnxruntime", gpu, "bad plan")
    refused = after_load_failure(
        gpu.model_copy(update={"fallback": "none"}), ("tensorrt",), "bad plan", fleet_engine=False
    )
    assert (refused.action, refused.reason) == ("give_up", fallback_refused("load", "bad plan"))
    assert refused.reason.startswith(FAILED_AT["load"])
    assert after_load_failure(gpu, ("onnxruntime",), "x", fleet_engine=False).action == "give_up"
    assert after_load_failure(None, ("tensorrt",), "x", fleet_engine=True) == after_load_failure(
        None, ("tensorrt",), "x", fleet_engine=False
    )


def test_an_int8_engine_that_fails_its_check_is_rebuilt_here_only_when_it_came_from_the_fleet() -> None:
    assert after_int8_check(failed=False, stage="agreement", fleet_engine=False) is None
    assert after_int8_check(failed=True, stage="agreement", fleet_engine=False) is None
    for stage in ("load", "agreement"):
        step = after_int8_check(failed=True, stage=stage, fleet_engine=True)
        assert step is not None
        assert step.action == "build_here"
    own = after_int8_check(failed=True, stage="load", fleet_engine=False)
    assert own is not None
    assert own.action == "give_up"
    assert from_fleet({"engine_source": {"origin": "downloaded"}})
    assert not from_fleet({"engine_source": {"origin": "built"}})
    assert not from_fleet({})


def test_a_rejected_int8_engine_is_rebuilt_at_fp16_past_tensorrt_after_a_load_failure() -> None:
    int8 = BuildSpec(device="gpu", precision="int8", calibration={"kind": "stream"})
    step = after_int8_rejected(int8, {})
    assert step.action == "rebuild_fp16"
    assert step.failure is None
    assert step.spec is not None
    assert (step.spec.precision, step.spec.calibration) == ("fp16", None)
    assert step.spec.device == "gpu"
    loaded = after_int8_rejected(int8, {"fallback": {"stage": "load", "error": "bad plan"}})
    assert loaded.failure == "bad plan"
    assert after_int8_rejected(int8, {"fallback": {"stage": "build", "error": "x"}}).failure is None
    default = after_int8_rejected(None, {})
    assert default.spec == BuildSpec().model_copy(update={"precision": "fp16", "calibration": None})
