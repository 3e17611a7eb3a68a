"""The build planner's rules, table-driven. Platform facts are built directly: no TensorRT, DLA or
Jetson exists on the test machines, so these describe the hardware the rules are written for."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.engines.building.plan import PlatformFacts, plan_build, shapes_dynamic
from agent.engines.placement.devices import engine_devices, placement_candidates
from agent.errors import BuildError
from agent.machine.platform import BackendAvailability, Platform
from agent.specs.build import BuildPlan, BuildSpec, CalibrationSource, ShapeProfile

# Platforms the rules are written for (facts as the platform probe would report them).
ORIN_AGX = PlatformFacts(tensorrt_version="10.3.0", dla_cores=2, has_gpu=True)
ORIN_NX_1DLA = PlatformFacts(tensorrt_version="10.3.0", dla_cores=1, has_gpu=True)
ORIN_NANO = PlatformFacts(tensorrt_version="10.3.0", dla_cores=0, has_gpu=True)
JP5_AGX = PlatformFacts(tensorrt_version="8.5.2.2", dla_cores=2, has_gpu=True)
TRT11_0 = PlatformFacts(tensorrt_version="11.0.0", dla_cores=2, has_gpu=True)
TRT11_4 = PlatformFacts(tensorrt_version="11.4.1", dla_cores=2, has_gpu=True)
CPU_ONLY = PlatformFacts(
    tensorrt_version=None, dla_cores=0, has_gpu=False, ort_providers=("CPUExecutionProvider",)
)
ORT_CUDA = PlatformFacts(
    tensorrt_version=None,
    dla_cores=0,
    has_gpu=True,
    ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
)
ORT_TRT_EP = PlatformFacts(
    tensorrt_version=None,
    dla_cores=0,
    has_gpu=True,
    ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
)
TRT_NO_GPU = PlatformFacts(tensorrt_version="10.3.0", dla_cores=0, has_gpu=False)

CACHE = {"kind": "cache", "path": Path("/var/lib/edge-agent/calibration/x.cache")}
DYNAMIC = {"input": "images", "min": (1, 3, 224, 224), "opt": (4, 3, 224, 224), "max": (8, 3, 224, 224)}
STATIC = {"input": "images", "min": (2, 3, 224, 224), "opt": (2, 3, 224, 224), "max": (2, 3, 224, 224)}


def spec(**fields: Any) -> BuildSpec:
    return BuildSpec.model_validate(fields)


@dataclass(frozen=True)
class Case:
    """One planner rule: a request on a platform, and what the plan must say."""

    id: str
    facts: PlatformFacts
    spec: dict[str, Any]
    expect: dict[str, Any]
    model_static: bool = True
    model_has_qdq: bool = False
    #: (field, requested, effective) of every change the plan must record.
    changes: set[tuple[str, str, str]] = field(default_factory=set)


CASES = [
    # --- backend -----------------------------------------------------------------------------
    Case(
        "no-trt-cpu-onnxruntime",
        CPU_ONLY,
        {"precision": "fp32"},
        {"backend": "onnxruntime", "device": "cpu", "precision": "fp32"},
        changes={("backend", "auto", "onnxruntime"), ("device", "auto", "cpu")},
    ),
    Case(
        "no-trt-cuda-ep-gpu",
        ORT_CUDA,
        {"precision": "fp32"},
        {"backend": "onnxruntime", "device": "gpu", "precision": "fp32"},
        changes={("backend", "auto", "onnxruntime"), ("device", "auto", "gpu")},
    ),
    Case(
        "no-trt-trt-ep-gpu-fp16",
        ORT_TRT_EP,
        {"precision": "fp16", "device": "gpu"},
        {"backend": "onnxruntime", "device": "gpu", "precision": "fp16"},
        changes={("backend", "auto", "onnxruntime")},
    ),
    Case(
        "trt-without-gpu-onnxruntime",
        TRT_NO_GPU,
        {"precision": "fp32"},
        {"backend": "onnxruntime", "device": "cpu"},
        changes={("backend", "auto", "onnxruntime"), ("device", "auto", "cpu")},
    ),
    Case(
        "device-cpu-uses-onnxruntime-even-with-trt",
        ORIN_AGX,
        {"device": "cpu", "precision": "fp32"},
        {"backend": "onnxruntime", "device": "cpu", "dla_core": None},
        changes={("backend", "auto", "onnxruntime")},
    ),
    Case(
        "gpu-requested-no-gpu-ep-cpu",
        CPU_ONLY,
        {"device": "gpu", "precision": "fp32"},
        {"backend": "onnxruntime", "device": "cpu"},
        changes={("backend", "auto", "onnxruntime"), ("device", "gpu", "cpu")},
    ),
    # --- device auto ---------------------------------------------------------------------------
    Case(
        "auto-dla0-when-dla-and-fp16",
        ORIN_AGX,
        {"device": "auto", "precision": "fp16"},
        {"backend": "tensorrt", "device": "dla", "dla_core": 0, "precision": "fp16", "gpu_fallback": True},
        changes={("device", "auto", "dla0")},
    ),
    Case(
        "auto-gpu-when-fp32",
        ORIN_AGX,
        {"device": "auto", "precision": "fp32"},
        {"device": "gpu", "dla_core": None, "precision": "fp32"},
        changes={("device", "auto", "gpu")},
    ),
    Case(
        "auto-gpu-when-no-dla",
        ORIN_NANO,
        {"device": "auto", "precision": "fp16"},
        {"device": "gpu", "precision": "fp16"},
        changes={("device", "auto", "gpu")},
    ),
    Case(
        "auto-gpu-when-dynamic-shapes",
        ORIN_AGX,
        {"device": "auto", "precision": "fp16", "profiles": [DYNAMIC]},
        {"device": "gpu", "profiles": [ShapeProfile.model_validate(DYNAMIC)]},
        changes={("device", "auto", "gpu")},
    ),
    Case(
        "auto-dla-when-dynamic-model-has-static-profile",
        ORIN_AGX,
        {"device": "auto", "precision": "fp16", "profiles": [STATIC]},
        {"device": "dla", "dla_core": 0},
        model_static=False,
        changes={("device", "auto", "dla0")},
    ),
    # --- explicit DLA --------------------------------------------------------------------------
    Case(
        "dla1-on-two-cores-kept",
        ORIN_AGX,
        {"device": "dla1", "precision": "fp16"},
        {"device": "dla", "dla_core": 1},
    ),
    Case(
        "dla1-on-one-core-gpu",
        ORIN_NX_1DLA,
        {"device": "dla1", "precision": "fp16"},
        {"device": "gpu", "dla_core": None, "gpu_fallback": False},
        changes={("device", "dla1", "gpu")},
    ),
    Case(
        "dla0-on-nano-gpu",
        ORIN_NANO,
        {"device": "dla0", "precision": "fp16"},
        {"device": "gpu"},
        changes={("device", "dla0", "gpu")},
    ),
    Case(
        "dla0-without-trt-or-gpu-cpu",
        CPU_ONLY,
        {"device": "dla0", "precision": "fp32"},
        {"backend": "onnxruntime", "device": "cpu"},
        changes={("backend", "auto", "onnxruntime"), ("device", "dla0", "cpu")},
    ),
    Case(
        "dla0-without-trt-gpu-ep-gpu",
        ORT_CUDA,
        {"device": "dla0", "precision": "fp32"},
        {"backend": "onnxruntime", "device": "gpu"},
        changes={("backend", "auto", "onnxruntime"), ("device", "dla0", "gpu")},
    ),
    Case(
        "gpu-fallback-kept-as-requested-on-dla",
        ORIN_AGX,
        {"device": "dla0", "precision": "fp16", "gpu_fallback": False},
        {"device": "dla", "gpu_fallback": False},
    ),
    Case(
        "dla-pools-kept-on-dla",
        ORIN_AGX,
        {"device": "dla0", "dla_sram_mb": 1, "dla_local_dram_mb": 512, "dla_global_dram_mb": 256},
        {"dla_sram_mb": 1, "dla_local_dram_mb": 512, "dla_global_dram_mb": 256},
    ),
    Case(
        "dla-pools-dropped-on-gpu",
        ORIN_AGX,
        {"device": "gpu", "dla_sram_mb": 1},
        {"dla_sram_mb": None, "gpu_fallback": False},
    ),
    # --- precision -----------------------------------------------------------------------------
    Case(
        "fp32-on-dla-becomes-fp16",
        ORIN_AGX,
        {"device": "dla0", "precision": "fp32"},
        {"device": "dla", "precision": "fp16"},
        changes={("precision", "fp32", "fp16")},
    ),
    Case(
        "best-with-calibration-int8",
        ORIN_AGX,
        {"precision": "best", "calibration": CACHE},
        {"device": "dla", "precision": "int8", "int8_mode": "calibrator", "allow_fp16": True},
        changes={("precision", "best", "int8"), ("device", "auto", "dla0")},
    ),
    Case(
        "best-with-qdq-int8",
        ORIN_AGX,
        {"precision": "best", "device": "gpu"},
        {"precision": "int8", "int8_mode": "qdq", "allow_fp16": False},
        model_has_qdq=True,
        changes={("precision", "best", "int8")},
    ),
    Case(
        "best-dla-fp16",
        ORIN_AGX,
        {"precision": "best"},
        {"device": "dla", "precision": "fp16", "int8_mode": "none"},
        changes={("precision", "best", "fp16"), ("device", "auto", "dla0")},
    ),
    Case(
        "best-gpu-fp16",
        ORIN_NANO,
        {"precision": "best"},
        {"device": "gpu", "precision": "fp16"},
        changes={("precision", "best", "fp16"), ("device", "auto", "gpu")},
    ),
    Case(
        "best-cpu-fp32",
        CPU_ONLY,
        {"precision": "best"},
        {"device": "cpu", "precision": "fp32"},
        changes={
            ("precision", "best", "fp32"),
            ("backend", "auto", "onnxruntime"),
            ("device", "auto", "cpu"),
        },
    ),
    Case(
        "best-cpu-with-calibration-int8-qdq",
        CPU_ONLY,
        {"precision": "best", "calibration": CACHE},
        {"device": "cpu", "precision": "int8", "int8_mode": "qdq"},
        changes={
            ("precision", "best", "int8"),
            ("backend", "auto", "onnxruntime"),
            ("device", "auto", "cpu"),
        },
    ),
    Case(
        "fp16-on-cpu-becomes-fp32",
        CPU_ONLY,
        {"precision": "fp16"},
        {"device": "cpu", "precision": "fp32"},
        changes={
            ("precision", "fp16", "fp32"),
            ("backend", "auto", "onnxruntime"),
            ("device", "auto", "cpu"),
        },
    ),
    Case(
        "fp16-on-ort-cuda-only-becomes-fp32",
        ORT_CUDA,
        {"precision": "fp16", "device": "gpu"},
        {"device": "gpu", "precision": "fp32"},
        changes={("precision", "fp16", "fp32"), ("backend", "auto", "onnxruntime")},
    ),
    Case(
        "fp32-on-gpu-kept",
        ORIN_AGX,
        {"device": "gpu", "precision": "fp32"},
        {"device": "gpu", "precision": "fp32"},
    ),
    # --- dynamic shapes on DLA -----------------------------------------------------------------
    Case(
        "dla-dynamic-profile-pinned-to-opt",
        ORIN_AGX,
        {"device": "dla0", "profiles": [DYNAMIC]},
        {
            "device": "dla",
            "profiles": [
                ShapeProfile(input="images", min=(4, 3, 224, 224), opt=(4, 3, 224, 224), max=(4, 3, 224, 224))
            ],
        },
        model_static=False,
        changes={("profiles.images", "min=1x3x224x224 opt=4x3x224x224 max=8x3x224x224", "4x3x224x224")},
    ),
    Case(
        "dla-static-profile-kept",
        ORIN_AGX,
        {"device": "dla0", "profiles": [STATIC]},
        {"device": "dla", "profiles": [ShapeProfile.model_validate(STATIC)]},
        model_static=False,
    ),
    Case(
        "gpu-dynamic-profile-kept",
        ORIN_AGX,
        {"device": "gpu", "profiles": [DYNAMIC]},
        {"device": "gpu", "profiles": [ShapeProfile.model_validate(DYNAMIC)]},
        model_static=False,
    ),
    Case(
        "dla1-fallback-gpu-keeps-dynamic-profile",
        ORIN_NX_1DLA,
        {"device": "dla1", "profiles": [DYNAMIC]},
        {"device": "gpu", "profiles": [ShapeProfile.model_validate(DYNAMIC)]},
        model_static=False,
        changes={("device", "dla1", "gpu")},
    ),
    # --- INT8 ----------------------------------------------------------------------------------
    Case(
        "int8-trt10-calibrator",
        ORIN_AGX,
        {"device": "gpu", "precision": "int8", "calibration": CACHE},
        {
            "precision": "int8",
            "int8_mode": "calibrator",
            "calibration": CalibrationSource.model_validate(CACHE),
        },
    ),
    Case(
        "int8-trt8-calibrator",
        JP5_AGX,
        {"device": "dla0", "precision": "int8", "calibration": CACHE},
        {"device": "dla", "int8_mode": "calibrator", "allow_fp16": True, "gpu_fallback": True},
    ),
    Case(
        "int8-qdq-model-drops-calibration",
        ORIN_AGX,
        {"device": "gpu", "precision": "int8", "calibration": CACHE},
        {"int8_mode": "qdq", "calibration": None},
        model_has_qdq=True,
        changes={("calibration", "cache", "none")},
    ),
    Case(
        "int8-qdq-model-without-calibration",
        ORIN_AGX,
        {"device": "gpu", "precision": "int8"},
        {"precision": "int8", "int8_mode": "qdq", "calibration": None},
        model_has_qdq=True,
    ),
    Case(
        "int8-trt11-qdq-mode",
        TRT11_4,
        {"device": "gpu", "precision": "int8", "calibration": CACHE},
        {"int8_mode": "qdq", "calibration": CalibrationSource.model_validate(CACHE)},
        changes={("int8_mode", "calibrator", "qdq")},
    ),
    Case(
        "trt11-0-has-no-dla",
        TRT11_0,
        {"device": "dla0", "precision": "int8", "calibration": CACHE},
        {"device": "gpu", "int8_mode": "qdq", "allow_fp16": False},
        changes={("device", "dla0", "gpu"), ("int8_mode", "calibrator", "qdq")},
    ),
    Case(
        "trt11-0-auto-gpu",
        TRT11_0,
        {"device": "auto", "precision": "fp16"},
        {"device": "gpu"},
        changes={("device", "auto", "gpu")},
    ),
    Case(
        "trt11-4-dla-back",
        TRT11_4,
        {"device": "dla1", "precision": "fp16"},
        {"device": "dla", "dla_core": 1},
    ),
    Case(
        "calibration-unused-for-fp16",
        ORIN_AGX,
        {"device": "gpu", "precision": "fp16", "calibration": CACHE},
        {"precision": "fp16", "int8_mode": "none", "calibration": None},
        changes={("calibration", "cache", "none")},
    ),
    Case(
        "int8-onnxruntime-cpu-qdq-from-calibration",
        CPU_ONLY,
        {"precision": "int8", "calibration": {"kind": "dataset", "path": Path("/data/cal")}},
        {"backend": "onnxruntime", "device": "cpu", "precision": "int8", "int8_mode": "qdq"},
        changes={("backend", "auto", "onnxruntime"), ("device", "auto", "cpu")},
    ),
    # --- carried through -----------------------------------------------------------------------
    Case(
        "limits-carried",
        ORIN_AGX,
        {"device": "gpu", "workspace_mb": 2048, "optimization_level": 5},
        {"workspace_mb": 2048, "optimization_level": 5},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_rules(case: Case) -> None:
    plan = plan_build(
        BuildSpec.model_validate(case.spec),
        case.facts,
        model_static=case.model_static,
        model_has_qdq=case.model_has_qdq,
    )
    for name, value in case.expect.items():
        assert getattr(plan, name) == value, f"{name}: {getattr(plan, name)!r} != {value!r}"
    recorded = {(c.field, c.requested, c.effective) for c in plan.changes}
    assert recorded == case.changes
    assert all(c.reason for c in plan.changes), "every change carries a reason"


@dataclass(frozen=True)
class Refusal:
    id: str
    facts: PlatformFacts
    spec: dict[str, Any]
    message: str
    model_static: bool = True
    model_has_qdq: bool = False


REFUSALS = [
    Refusal("int8-without-scales", ORIN_AGX, {"precision": "int8"}, "INT8 needs a calibration cache"),
    Refusal("int8-without-scales-on-cpu", CPU_ONLY, {"precision": "int8"}, "or a Q/DQ model"),
    Refusal(
        "dla-dynamic-model-without-profile",
        ORIN_AGX,
        {"device": "dla0"},
        "DLA needs static input shapes",
        model_static=False,
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[r.id for r in REFUSALS])
def test_plan_refusals(case: Refusal) -> None:
    with pytest.raises(BuildError, match=case.message):
        plan_build(
            BuildSpec.model_validate(case.spec),
            case.facts,
            model_static=case.model_static,
            model_has_qdq=case.model_has_qdq,
        )


def test_reasons_name_the_core_count() -> None:
    plan = plan_build(spec(device="dla1"), ORIN_NX_1DLA, model_static=True)
    (change,) = plan.changes
    assert "1 DLA core" in change.reason


def test_reason_names_trt11_without_dla() -> None:
    plan = plan_build(spec(device="dla0"), TRT11_0, model_static=True)
    assert "11.0-11.3" in plan.changes[0].reason


def test_plan_is_a_valid_build_plan_and_pure() -> None:
    request = spec(precision="best", calibration=CACHE)
    first = plan_build(request, ORIN_AGX, model_static=True)
    second = plan_build(request, ORIN_AGX, model_static=True)
    assert isinstance(first, BuildPlan)
    assert first == second
    assert BuildPlan.model_validate_json(first.model_dump_json()) == first


@pytest.mark.parametrize(
    ("profiles", "model_static", "dynamic"),
    [
        ([], True, False),
        ([], False, True),
        ([STATIC], False, False),
        ([DYNAMIC], True, True),
        ([STATIC, {**DYNAMIC, "input": "mask"}], False, True),
    ],
    ids=["static-model", "dynamic-no-profile", "static-profile", "dynamic-profile", "one-of-two-dynamic"],
)
def test_shapes_dynamic(profiles: list[dict[str, Any]], model_static: bool, dynamic: bool) -> None:
    assert shapes_dynamic(spec(profiles=profiles), model_static) is dynamic


def test_facts_from_platform() -> None:
    platform = Platform(
        is_jetson=True,
        tensorrt_version="10.3.0",
        dla_cores=2,
        ort_providers=("CPUExecutionProvider",),
        backends={"tensorrt": BackendAvailability(True, "ok")},
    )
    facts = PlatformFacts.from_platform(platform)
    assert facts == PlatformFacts("10.3.0", 2, True, ("CPUExecutionProvider",))


def test_facts_from_platform_unusable_tensorrt_counts_as_absent() -> None:
    platform = Platform(
        tensorrt_version="10.3.0",
        backends={"tensorrt": BackendAvailability(False, "no GPU")},
    )
    facts = PlatformFacts.from_platform(platform)
    assert facts.tensorrt_version is None
    assert facts.dla_cores == 0
    assert not facts.has_gpu


def test_fallback_is_refused_for_an_unknown_value() -> None:
    with pytest.raises(ValueError, match="fallback"):
        spec(fallback="cuda")


THOR_JP7 = PlatformFacts(
    tensorrt_version="10.13.3", dla_cores=0, has_gpu=True, no_dla="Jetson Thor (tegra264) has no DLA"
)


@pytest.mark.parametrize(
    ("facts", "fields", "model_static", "candidates"),
    [
        (ORIN_AGX, {"precision": "fp16"}, True, ("gpu", "dla0", "dla1")),
        (ORIN_NX_1DLA, {"precision": "int8", "calibration": CACHE}, True, ("gpu", "dla0")),
        (ORIN_NANO, {"precision": "fp16"}, True, ("gpu",)),
        (JP5_AGX, {"precision": "best"}, True, ("gpu", "dla0", "dla1")),
        (ORIN_AGX, {"precision": "fp32"}, True, ("gpu",)),  # DLA runs FP16/INT8 only
        (ORIN_AGX, {"precision": "fp16"}, False, ("gpu",)),  # dynamic shapes: DLA needs static
        (TRT11_0, {"precision": "fp16"}, True, ("gpu",)),  # no DLA in TensorRT 11.0-11.3
        (THOR_JP7, {"precision": "fp16"}, True, ("gpu",)),
        (CPU_ONLY, {"precision": "fp16"}, True, ("auto",)),
        (ORIN_AGX, {"precision": "fp16", "device": "dla1"}, True, ("dla1",)),  # explicit: not second-guessed
    ],
    ids=[
        "orin-agx",
        "orin-nx-one-dla",
        "orin-nano-no-dla",
        "jetpack5-agx",
        "fp32-gpu-only",
        "dynamic-gpu-only",
        "trt11.0-gpu-only",
        "thor-jetpack7-gpu-only",
        "no-tensorrt",
        "explicit-device",
    ],
)
def test_placement_candidates(
    facts: PlatformFacts, fields: dict[str, Any], model_static: bool, candidates: tuple[str, ...]
) -> None:
    assert placement_candidates(spec(**fields), facts, model_static=model_static) == candidates


def test_thor_plans_the_gpu_and_names_the_chip() -> None:
    plan = plan_build(spec(device="auto"), THOR_JP7, model_static=True)
    assert (plan.backend, plan.device, plan.precision) == ("tensorrt", "gpu", "fp16")
    (change,) = plan.changes
    assert change.reason == "no usable DLA core: Jetson Thor (tegra264) has no DLA"
    plan = plan_build(spec(device="dla0"), THOR_JP7, model_static=True)
    assert plan.device == "gpu"
    assert "Thor (tegra264) has no DLA" in plan.changes[0].reason


def test_thor_int8_calibrates_through_the_tensorrt_10_calibrator() -> None:
    # TensorRT 10.13 (JetPack 7) still has the implicit INT8 calibrators; 11 removed them.
    plan = plan_build(spec(precision="int8", device="gpu", calibration=CACHE), THOR_JP7, model_static=True)
    assert plan.int8_mode == "calibrator"


def test_ort_tensorrt_provider_options_are_planned_only_where_that_provider_builds() -> None:
    fields = {
        "device": "gpu",
        "ep_context": "file",
        "trt_context_memory_sharing": True,
        "trt_auxiliary_streams": 2,
    }
    on_trt_ep = plan_build(spec(**fields), ORT_TRT_EP, model_static=True)
    assert (on_trt_ep.ep_context, on_trt_ep.trt_context_memory_sharing, on_trt_ep.trt_auxiliary_streams) == (
        "file",
        True,
        2,
    )
    for facts in (ORT_CUDA, CPU_ONLY, ORIN_AGX):  # CUDA provider, CPU, native TensorRT
        other = plan_build(spec(**fields), facts, model_static=True)
        assert (other.ep_context, other.trt_context_memory_sharing, other.trt_auxiliary_streams) == (
            "off",
            False,
            None,
        )


# -- one slot on several devices (build.devices) -------------------------------------------------

ENGINE_DEVICES = [
    # (facts, spec fields, model static, devices the slot runs engines on)
    (ORIN_AGX, {"devices": "auto"}, True, ["dla0", "dla1", "gpu"]),
    (JP5_AGX, {"devices": "auto", "precision": "int8", "calibration": CACHE}, True, ["dla0", "dla1", "gpu"]),
    (ORIN_NX_1DLA, {"devices": "auto"}, True, ["dla0", "gpu"]),
    (ORIN_NANO, {"devices": "auto"}, True, ["gpu"]),
    (THOR_JP7, {"devices": "auto"}, True, ["gpu"]),
    (TRT11_0, {"devices": "auto"}, True, ["gpu"]),
    (ORIN_AGX, {"devices": "auto", "precision": "fp32"}, True, ["gpu"]),
    (ORIN_AGX, {"devices": "auto"}, False, ["gpu"]),  # dynamic shapes, no profile: no DLA
    (ORT_CUDA, {"devices": "auto"}, True, ["gpu"]),
    (CPU_ONLY, {"devices": "auto"}, True, ["cpu"]),
    (CPU_ONLY, {"devices": ["dla0", "dla1", "gpu"]}, True, ["dla0", "dla1", "gpu"]),  # each planned apart
    (CPU_ONLY, {"devices": ["cpu", "cpu", "cpu"]}, True, ["cpu", "cpu", "cpu"]),
    (ORIN_AGX, {"device": "dla1"}, True, ["dla1"]),  # no devices: one engine on device
]


@pytest.mark.parametrize(("facts", "fields", "static", "devices"), ENGINE_DEVICES)
def test_engine_devices(
    facts: PlatformFacts, fields: dict[str, Any], static: bool, devices: list[str]
) -> None:
    chosen = engine_devices(spec(**fields), facts, model_static=static)
    assert [device for device, _ in chosen] == devices
    assert all(reason for _, reason in chosen), "every engine's device has a reason"


def test_engine_devices_auto_names_why_there_is_no_gpu_or_dla() -> None:
    [(device, reason)] = engine_devices(spec(devices="auto"), CPU_ONLY, model_static=True)
    assert device == "cpu"
    assert "no GPU or DLA usable here" in reason


def test_each_engine_of_a_set_is_planned_like_device() -> None:
    """dla1 on a one-DLA Orin NX is planned onto the GPU, and its plan says why (its own cache key)."""
    request = spec(devices=["dla0", "dla1"])
    plans = [
        plan_build(request.for_device(d), ORIN_NX_1DLA, model_static=True)
        for d, _ in engine_devices(request, ORIN_NX_1DLA, model_static=True)
    ]
    assert [(p.device, p.dla_core) for p in plans] == [("dla", 0), ("gpu", None)]
    assert "dla1 requested" in plans[1].changes[0].reason


@pytest.mark.parametrize("devices", [[], ["gpu"] * 9, ["dla2"], ["auto"]])
def test_a_bad_devices_list_is_refused_naming_the_field(devices: list[str]) -> None:
    with pytest.raises(ValueError, match="devices"):
        BuildSpec.model_validate({"devices": devices})
