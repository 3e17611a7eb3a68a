"""ONNX Runtime build: provider options from the plan (pure), FP32 and INT8 artifacts (real ORT)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from agent.demo.modelzoo import write_classifier
from agent.engines.building.ort import (
    CPU_EP,
    CUDA_EP,
    TABLE_FILE,
    TENSORRT_EP,
    TRT_CACHE_FILE,
    OrtPaths,
    build_onnxruntime,
    ep_context_options,
    provider_names,
    provider_options,
    tensorrt_provider_options,
)
from agent.engines.calibration.data import save_batches
from agent.engines.job import BuildJob
from agent.errors import BuildError
from agent.model_contract.calibration_table import read_table
from agent.model_contract.trt_cache import read_trt_cache
from agent.specs.build import BuildPlan, CalibrationSource, ShapeProfile

PATHS = OrtPaths(engine_cache_dir=Path("/s/engines/k/trt_engines"), timing_cache_dir=Path("/s/timing"))
ALL = (TENSORRT_EP, CUDA_EP, CPU_EP)


def plan(**fields: object) -> BuildPlan:
    base: dict[str, object] = {"backend": "onnxruntime", "precision": "fp32", "device": "gpu"}
    base.update(fields)
    return BuildPlan.model_validate(base)


# --------------------------------------------------------------------------- provider options


def test_cpu_plan_gets_only_the_cpu_provider() -> None:
    assert provider_options(plan(device="cpu"), PATHS, ALL) == [(CPU_EP, {})]


def test_gpu_plan_orders_tensorrt_cuda_cpu() -> None:
    providers = provider_options(plan(precision="fp16"), PATHS, ALL)
    assert provider_names(providers) == [TENSORRT_EP, CUDA_EP, CPU_EP]
    trt = providers[0][1]
    assert trt["trt_fp16_enable"] == "True"
    assert trt["trt_int8_enable"] == "False"
    assert trt["trt_engine_cache_enable"] == "True"
    assert trt["trt_engine_cache_path"] == "/s/engines/k/trt_engines"
    assert trt["trt_timing_cache_enable"] == "True"
    assert trt["trt_timing_cache_path"] == "/s/timing"
    assert trt["trt_builder_optimization_level"] == "3"
    assert trt["trt_max_workspace_size"] == str(1024 << 20)
    assert "trt_dla_enable" not in trt
    assert providers[1] == (CUDA_EP, {"device_id": "0"})
    # Every value is a string: ORT's binding parses them.
    assert all(isinstance(v, str) for v in trt.values())


def test_unavailable_providers_are_dropped_cpu_kept() -> None:
    assert provider_names(provider_options(plan(), PATHS, (CUDA_EP, CPU_EP))) == [CUDA_EP, CPU_EP]
    assert provider_names(provider_options(plan(), PATHS, ())) == [CPU_EP]
    assert provider_names(provider_options(plan(), PATHS, None)) == [TENSORRT_EP, CUDA_EP, CPU_EP]


def test_dla_int8_calibrator_options() -> None:
    options = tensorrt_provider_options(
        plan(
            precision="int8",
            device="dla",
            dla_core=1,
            int8_mode="calibrator",
            allow_fp16=True,
            workspace_mb=256,
            optimization_level=5,
        ),
        OrtPaths(Path("/c"), Path("/t"), calibration_table="calibration.trt.cache"),
    )
    assert options["trt_dla_enable"] == "True"
    assert options["trt_dla_core"] == "1"
    assert options["trt_int8_enable"] == "True"
    assert options["trt_fp16_enable"] == "True"  # DLA INT8 needs FP16 next to it
    assert options["trt_int8_calibration_table_name"] == "calibration.trt.cache"
    assert options["trt_int8_use_native_calibration_table"] == "True"
    assert options["trt_max_workspace_size"] == str(256 << 20)
    assert options["trt_builder_optimization_level"] == "5"


def test_qdq_model_never_gets_a_calibration_table() -> None:
    options = tensorrt_provider_options(
        plan(precision="int8", int8_mode="qdq"), OrtPaths(Path("/c"), Path("/t"), calibration_table="t.cache")
    )
    assert options["trt_int8_enable"] == "True"
    assert "trt_int8_calibration_table_name" not in options


def test_profiles_become_shape_strings_sorted_by_input() -> None:
    profiles = [
        ShapeProfile(input="z", min=(1, 4), opt=(2, 4), max=(8, 4)),
        ShapeProfile(input="images", min=(1, 3, 64, 64), opt=(4, 3, 64, 64), max=(8, 3, 64, 64)),
    ]
    options = tensorrt_provider_options(plan(profiles=profiles), PATHS)
    assert options["trt_profile_min_shapes"] == "images:1x3x64x64,z:1x4"
    assert options["trt_profile_opt_shapes"] == "images:4x3x64x64,z:2x4"
    assert options["trt_profile_max_shapes"] == "images:8x3x64x64,z:8x4"


def test_options_are_accepted_by_this_onnxruntime_for_cpu(tmp_path: Path) -> None:
    """The CPU options really load (the TensorRT ones need an ORT built with TensorRT: not here)."""
    model = write_classifier(tmp_path / "m.onnx", input_size=16, num_classes=3)
    providers = provider_options(plan(), PATHS, ort.get_available_providers())
    session = ort.InferenceSession(
        str(model), providers=provider_names(providers), provider_options=[o for _, o in providers]
    )
    assert session.get_providers()[-1] == CPU_EP


# --------------------------------------------------------------------------- builds (in process)


def job(tmp_path: Path, model: Path, build_plan: BuildPlan, calibration_dir: Path | None = None) -> BuildJob:
    return BuildJob(
        kind="onnxruntime",
        model=model,
        out_dir=tmp_path / "out",
        plan=build_plan,
        engine_file="model.onnx",
        calibration_dir=calibration_dir,
        timing_cache=tmp_path / "timing" / "ort",
    )


def test_fp32_cpu_build_writes_an_optimized_model_with_the_same_outputs(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "m.onnx", input_size=32, num_classes=5)
    result = build_onnxruntime(job(tmp_path, model, plan(device="cpu")), lambda _m: None)
    engine = tmp_path / "out" / result.engine_file
    assert result.files == ()
    assert result.report["providers"] == [CPU_EP]
    x = np.random.default_rng(0).random((3, 3, 32, 32), dtype=np.float32)
    want = ort.InferenceSession(str(model), providers=[CPU_EP]).run(None, {"images": x})[0]
    got = ort.InferenceSession(str(engine), providers=[CPU_EP]).run(None, {"images": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_int8_build_writes_qdq_model_table_and_trt_cache(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "m.onnx", input_size=32, num_classes=5)
    rng = np.random.default_rng(1)
    count, _ = save_batches((rng.random((4, 3, 32, 32), dtype=np.float32) for _ in range(4)), tmp_path / "c")
    assert count == 4
    build_plan = plan(
        device="cpu",
        precision="int8",
        int8_mode="qdq",
        calibration=CalibrationSource(kind="stream", stream="cam", frames=16),
    )
    result = build_onnxruntime(
        job(tmp_path, model, build_plan, tmp_path / "c").model_copy(update={"trt_cache_version": "10.3.0"}),
        lambda _m: None,
    )
    out = tmp_path / "out"
    assert set(result.files) == {TABLE_FILE, TRT_CACHE_FILE}
    ranges, method = read_table(out / TABLE_FILE)
    assert method == "entropy"
    cache = read_trt_cache((out / TRT_CACHE_FILE).read_bytes())
    assert cache.version_tag == 100300
    assert cache.algorithm == "EntropyCalibration2"
    assert set(cache.scales) == set(ranges)
    # The ORT-optimized Q/DQ model still runs, with quantized operators inside.
    engine = out / result.engine_file
    ops = {node.op_type for node in onnx.load(str(engine)).graph.node}
    assert ops & {"QuantizeLinear", "QLinearConv", "DequantizeLinear"}
    x = rng.random((2, 3, 32, 32), dtype=np.float32)
    (scores,) = ort.InferenceSession(str(engine), providers=[CPU_EP]).run(None, {"images": x})
    assert scores.shape == (2, 5)
    assert not (out / "int8").exists()


def test_int8_without_frames_is_refused(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "m.onnx", input_size=16)
    build_plan = plan(
        device="cpu",
        precision="int8",
        int8_mode="calibrator",
        calibration=CalibrationSource(kind="cache", path=tmp_path / "x.cache"),
    )
    with pytest.raises(BuildError, match="needs calibration frames"):
        build_onnxruntime(job(tmp_path, model, build_plan), lambda _m: None)


# --------------------------------------------------------------------------- EP context, run options
# The TensorRT provider is absent here: the mapping is pure and tested as such.

DUMP = Path("/s/build/out/model_ctx.onnx")


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (
            "embed",
            {
                "trt_dump_ep_context_model": "True",
                "trt_ep_context_file_path": str(DUMP),
                "trt_ep_context_embed_mode": "1",
            },
        ),
        (
            "file",
            {
                "trt_dump_ep_context_model": "True",
                "trt_ep_context_file_path": str(DUMP),
                "trt_ep_context_embed_mode": "0",
            },
        ),
        ("off", {}),
    ],
)
def test_ep_context_dump_options_at_build_time(mode: str, expected: dict[str, str]) -> None:
    assert ep_context_options(plan(ep_context=mode), DUMP) == expected
    build_paths = OrtPaths(PATHS.engine_cache_dir, PATHS.timing_cache_dir, ep_context_dump=DUMP)
    options = tensorrt_provider_options(plan(ep_context=mode), build_paths)
    assert {k: v for k, v in options.items() if "ep_context" in k} == expected


def test_loading_never_dumps_the_ep_context_again() -> None:
    assert ep_context_options(plan(ep_context="embed"), None) == {}
    options = tensorrt_provider_options(plan(ep_context="embed"), PATHS)
    assert not any("ep_context" in k for k in options)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {}),
        ({"trt_context_memory_sharing": True}, {"trt_context_memory_sharing_enable": "True"}),
        ({"trt_auxiliary_streams": 0}, {"trt_auxiliary_streams": "0"}),
        (
            {"trt_context_memory_sharing": True, "trt_auxiliary_streams": -1},
            {"trt_context_memory_sharing_enable": "True", "trt_auxiliary_streams": "-1"},
        ),
    ],
    ids=["defaults", "memory-sharing", "no-aux-streams", "both"],
)
def test_run_options_only_where_the_plan_asks(fields: dict[str, object], expected: dict[str, str]) -> None:
    options = tensorrt_provider_options(plan(**fields), PATHS)
    keys = ("trt_context_memory_sharing_enable", "trt_auxiliary_streams")
    assert {k: options[k] for k in keys if k in options} == expected
