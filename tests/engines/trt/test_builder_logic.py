"""The pure parts of the TensorRT builder and calibrator, tested without TensorRT.

The log and inspector samples follow the formats TensorRT prints (8.x-10.x trtexec output,
the messages a custom ``ILogger`` receives, the 7.x one-line form, the engine-inspector JSON);
the layer names are made up. Nothing here claims a real TensorRT build ran.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.backends.trt_api import tensorrt_status
from agent.engines.trt.builder import build_engine
from agent.engines.trt.calibrator import (
    CalibrationFeed,
    make_entropy_calibrator,
    read_cache_bytes,
    write_cache_bytes,
)
from agent.engines.trt.decisions import (
    ProfileShape,
    builder_flags,
    calibration_batch_size,
    calibration_problem,
    format_parser_errors,
    network_flags,
    plan_problems,
    pool_limits,
    profile_shapes,
    target_label,
    warning_lines,
)
from agent.engines.trt.log import BuildLog
from agent.engines.trt.placement import (
    Placement,
    classify_inspector_layer,
    combine_placement,
    parse_inspector_json,
    parse_placement_log,
)
from agent.errors import BuildError
from agent.specs.build import BuildPlan, ShapeProfile

_TRT_HERE = tensorrt_status()[0]


def _plan(**kwargs: Any) -> BuildPlan:
    base: dict[str, Any] = {"backend": "tensorrt", "precision": "fp16", "device": "gpu"}
    base.update(kwargs)
    return BuildPlan(**base)


def _dla_plan(**kwargs: Any) -> BuildPlan:
    return _plan(device="dla", dla_core=0, gpu_fallback=True, **kwargs)


# --- network flags, pools, builder flags -------------------------------------------------------


def test_explicit_batch_flag_only_below_tensorrt_10() -> None:
    assert network_flags(8) == 1
    assert network_flags(8, explicit_batch_bit=0) == 1
    assert network_flags(10) == 0
    assert network_flags(11) == 0


def test_pool_limits_on_gpu_are_only_the_workspace() -> None:
    plan = _plan(workspace_mb=512, dla_sram_mb=1)
    assert pool_limits(plan) == [("WORKSPACE", 512 * 2**20)]


def test_pool_limits_on_dla_add_only_the_dla_pools_that_are_set() -> None:
    plan = _dla_plan(workspace_mb=256, dla_sram_mb=1, dla_global_dram_mb=512)
    assert pool_limits(plan) == [
        ("WORKSPACE", 256 * 2**20),
        ("DLA_MANAGED_SRAM", 2**20),
        ("DLA_GLOBAL_DRAM", 512 * 2**20),
    ]


@pytest.mark.parametrize(
    ("plan_kwargs", "major", "expected"),
    [
        ({"precision": "fp32"}, 10, []),
        ({"precision": "fp16"}, 10, ["FP16"]),
        ({"precision": "int8", "int8_mode": "calibrator"}, 10, ["INT8"]),
        ({"precision": "int8", "int8_mode": "qdq"}, 8, ["INT8"]),
        ({"precision": "int8", "int8_mode": "qdq"}, 11, []),
    ],
)
def test_builder_flags_on_gpu(plan_kwargs: dict[str, Any], major: int, expected: list[str]) -> None:
    assert builder_flags(_plan(**plan_kwargs), major) == expected


def test_int8_on_dla_also_sets_fp16_and_fallback_is_a_flag() -> None:
    plan = _dla_plan(precision="int8", int8_mode="calibrator")
    assert builder_flags(plan, 10) == ["INT8", "FP16", "GPU_FALLBACK"]
    strict = _plan(device="dla", dla_core=1, gpu_fallback=False, precision="fp16")
    assert builder_flags(strict, 8) == ["FP16"]


# --- plan checks -------------------------------------------------------------------------------


def test_a_sound_plan_has_no_problems() -> None:
    assert plan_problems(_dla_plan(precision="int8", int8_mode="calibrator", dla_sram_mb=1), 10, 2) == []
    assert plan_problems(_plan(), 10) == []


def test_plan_problems_name_every_mistake() -> None:
    plan = _plan(
        device="dla",
        dla_core=2,
        precision="fp32",
        dla_local_dram_mb=768,
        profiles=[
            ShapeProfile(input="images", min=(1, 3, 224, 224), opt=(4, 3, 224, 224), max=(8, 3, 224, 224))
        ],
    )
    problems = plan_problems(plan, 10, num_dla_cores=2)
    text = "\n".join(problems)
    assert "DLA core 2 requested but this device has 2" in text
    assert "DLA runs only fp16 or int8" in text
    assert "static shapes" in text
    assert "dla_local_dram_mb must be a power of two" in text
    assert len(problems) == 4


def test_plan_problems_for_backend_cpu_and_int8_modes() -> None:
    assert any("onnxruntime" in p for p in plan_problems(_plan(device="cpu"), 10))
    assert any("backend 'onnxruntime'" in p for p in plan_problems(_plan(backend="onnxruntime"), 10))
    assert any("needs int8_mode" in p for p in plan_problems(_plan(precision="int8"), 10))
    removed = plan_problems(_plan(precision="int8", int8_mode="calibrator"), 11)
    assert any("TensorRT 11 removed INT8 calibrators" in p for p in removed)
    assert any(
        "int8_mode 'qdq' with precision 'fp16'" in p for p in plan_problems(_plan(int8_mode="qdq"), 10)
    )
    assert any("needs a dla_core" in p for p in plan_problems(_plan(device="dla"), 10))


# --- optimisation profiles ---------------------------------------------------------------------


def test_static_networks_need_no_profile() -> None:
    assert profile_shapes([], [("images", (1, 3, 224, 224))]) == []


def test_a_dynamic_batch_without_a_profile_is_pinned_to_one() -> None:
    (shape,) = profile_shapes([], [("images", (-1, 3, 224, 224))])
    assert shape.input == "images"
    assert shape.min == shape.opt == shape.max == (1, 3, 224, 224)


def test_the_plans_profile_is_used_for_a_dynamic_input() -> None:
    profile = ShapeProfile(input="images", min=(1, 3, 320, 320), opt=(2, 3, 640, 640), max=(4, 3, 640, 640))
    shapes = profile_shapes([profile], [("images", (-1, 3, -1, -1)), ("scale", (1,))])
    assert len(shapes) == 1
    assert (shapes[0].min, shapes[0].opt, shapes[0].max) == (profile.min, profile.opt, profile.max)


def test_dynamic_spatial_axes_without_a_profile_are_an_error() -> None:
    with pytest.raises(BuildError, match=r"dynamic axes \[2, 3\].*add a shape profile"):
        profile_shapes([], [("images", (1, 3, -1, -1))])


def test_profiles_must_match_the_network() -> None:
    wrong_name = ShapeProfile(input="image", min=(1, 3, 8, 8), opt=(1, 3, 8, 8), max=(1, 3, 8, 8))
    with pytest.raises(BuildError, match=r"inputs the model does not have: \['image'\]"):
        profile_shapes([wrong_name], [("images", (-1, 3, 8, 8))])
    changes_fixed = ShapeProfile(input="images", min=(1, 1, 8, 8), opt=(1, 1, 8, 8), max=(1, 1, 8, 8))
    with pytest.raises(BuildError, match="changes axis 1, which the model fixes at 3"):
        profile_shapes([changes_fixed], [("images", (-1, 3, 8, 8))])
    wrong_rank = ShapeProfile(input="images", min=(1, 3), opt=(1, 3), max=(1, 3))
    with pytest.raises(BuildError, match="rank 2, the model input has rank 4"):
        profile_shapes([wrong_rank], [("images", (-1, 3, 8, 8))])


def test_parser_errors_are_all_listed() -> None:
    errors = [
        "In node 12 with name: /head/NonMaxSuppression and operator: NonMaxSuppression "
        '(importFallbackPluginImporter): UNSUPPORTED_NODE: Assertion failed: creator && "Plugin not found"',
        "In node 40 with name: /post/TopK and operator: TopK: UNSUPPORTED_NODE: K must be an initializer",
    ]
    message = format_parser_errors(errors, Path("/models/abc.onnx"))
    assert "abc.onnx (2 error(s))" in message
    assert "1. In node 12" in message
    assert "2. In node 40" in message
    assert "no parser error reported" in format_parser_errors([], Path("m.onnx"))


# --- placement from the build log --------------------------------------------------------------

TRTEXEC_8X_LOG = """\
[05/14/2024-09:12:01] [W] [TRT] Layer '/neck/Resize' (RESIZE): Unsupported on DLA. Switching to GPU.
[05/14/2024-09:12:01] [W] [TRT] Layer '/head/Reshape' (SHUFFLE): Unsupported on DLA. Switching to GPU.
[05/14/2024-09:12:02] [I] [TRT] ---------- Layers Running on DLA ----------
[05/14/2024-09:12:02] [I] [TRT] [DlaLayer] {ForeignNode[/backbone/stem/Conv.../backbone/stage2/act/Relu]}
[05/14/2024-09:12:02] [I] [TRT] [DlaLayer] {ForeignNode[/neck/conv1/Conv.../neck/conv3/Relu]}
[05/14/2024-09:12:02] [I] [TRT] [DlaLayer] {ForeignNode[/head/cls/Conv]}
[05/14/2024-09:12:02] [I] [TRT] ---------- Layers Running on GPU ----------
[05/14/2024-09:12:02] [I] [TRT] [GpuLayer] RESIZE: /neck/Resize
[05/14/2024-09:12:02] [I] [TRT] [GpuLayer] SHUFFLE: /head/Reshape + (Unnamed Layer* 88) [Shuffle]
[05/14/2024-09:12:02] [I] [TRT] [GpuLayer] POINTWISE: PWN(PWN(/head/Sigmoid, /head/Mul), /head/Add)
[05/14/2024-09:12:04] [I] [TRT] Detected 1 inputs and 2 output network tensors.
"""

# What a custom ILogger receives from TensorRT 10 (no prefixes; the block comes at VERBOSE).
LOGGER_10X_MESSAGES = [
    ("VERBOSE", "After Myelin optimization: 41 layers"),
    ("VERBOSE", "---------- Layers Running on DLA ----------"),
    ("VERBOSE", "[DlaLayer] {ForeignNode[/model/conv1/Conv.../model/fc/Gemm]}"),
    ("VERBOSE", "---------- Layers Running on GPU ----------"),
    ("VERBOSE", "No layer is running on GPU"),
    ("VERBOSE", "DLA Memory Pool Sizes: Managed SRAM = 1 MiB, Local DRAM = 1024 MiB, Global DRAM = 512 MiB"),
    ("INFO", "[MemUsageChange] Init builder kernel library: CPU +0, GPU +12, now: CPU 310, GPU 2940 (MiB)"),
]

TRT_7X_LOG = """\
[TensorRT] INFO:
[TensorRT] INFO: --------------- Layers running on DLA:
[TensorRT] INFO: {conv_1,bn_1,relu_1}, {conv_2,bn_2}, {conv_5,bn_5,relu_5,conv_6},
[TensorRT] INFO: --------------- Layers running on GPU:
[TensorRT] INFO: upsample_3, concat_4, PWN(leaky_7, add_8), (Unnamed Layer* 21) [Constant] + bias_22 [Shuffle]
[TensorRT] INFO: Some tactics do not have sufficient workspace memory to run.
"""

SAMPLE_CUDLA_STYLE = """\
[I] [TRT]
[I] [TRT] --------------- Layers running on DLA:
[I] [TRT] [DlaLayer] {ForeignNode[(Unnamed Layer* 0) [ElementWise]]},
[I] [TRT] --------------- Layers running on GPU:
[I] [TRT]
[I] [TRT] Total Activation Memory: 8
"""


def test_placement_from_trtexec_8x_output() -> None:
    placement = parse_placement_log(TRTEXEC_8X_LOG)
    assert placement is not None
    assert (placement.dla_layers, placement.gpu_layers) == (3, 3)
    assert placement.layers[0].name == "{ForeignNode[/backbone/stem/Conv.../backbone/stage2/act/Relu]}"
    assert placement.layers[0].kind == "ForeignNode"
    gpu = [lp for lp in placement.layers if lp.device == "gpu"]
    assert [lp.kind for lp in gpu] == ["RESIZE", "SHUFFLE", "POINTWISE"]
    assert gpu[2].name == "PWN(PWN(/head/Sigmoid, /head/Mul), /head/Add)"
    assert placement.source == "log"


def test_placement_from_messages_captured_by_the_logger() -> None:
    build_log = BuildLog()
    for severity, message in LOGGER_10X_MESSAGES:
        build_log.add(severity, message)
    placement = parse_placement_log(build_log.placement_text())
    assert placement is not None
    assert (placement.dla_layers, placement.gpu_layers) == (1, 0)
    # Verbose lines are not kept in the log text, INFO is.
    assert "After Myelin" not in build_log.text()
    assert "[I] [MemUsageChange]" in build_log.text()


def test_placement_from_the_7x_one_line_form() -> None:
    placement = parse_placement_log(TRT_7X_LOG)
    assert placement is not None
    assert placement.dla_layers == 3
    assert placement.gpu_layers == 4
    assert placement.layers[0].name == "{conv_1,bn_1,relu_1}"
    names = [lp.name for lp in placement.layers if lp.device == "gpu"]
    assert names[2] == "PWN(leaky_7, add_8)"
    assert names[3] == "(Unnamed Layer* 21) [Constant] + bias_22 [Shuffle]"


def test_placement_block_that_ends_on_an_empty_line() -> None:
    placement = parse_placement_log(SAMPLE_CUDLA_STYLE)
    assert placement is not None
    assert (placement.dla_layers, placement.gpu_layers) == (1, 0)
    assert placement.layers[0].name == "{ForeignNode[(Unnamed Layer* 0) [ElementWise]]}"


def test_a_gpu_only_log_has_no_placement_block() -> None:
    text = (
        "[I] [TRT] Detected 1 inputs and 1 output network tensors.\n[I] [TRT] Total Activation Memory: 12\n"
    )
    assert parse_placement_log(text) is None


def test_build_log_keeps_a_bounded_tail_and_forwards_errors() -> None:
    forwarded: list[str] = []
    build_log = BuildLog(max_lines=5, sink=forwarded.append)
    for i in range(20):
        build_log.add("INFO", f"message {i}")
    build_log.add(
        "ERROR", "[network.cpp::validate::3100] Error Code 4: Internal Error (profile has no shape)"
    )
    build_log.add("INTERNAL_ERROR", "Assertion failed: engine")
    lines = build_log.text().splitlines()
    assert len(lines) == 5
    assert lines[-1] == "[F] Assertion failed: engine"
    assert "message 0" not in build_log.text()
    assert build_log.tail(2).splitlines()[0].startswith("[E] [network.cpp")
    assert forwarded == [lines[-2], lines[-1]]
    assert len(build_log.errors) == 2


# --- placement from the engine inspector -------------------------------------------------------

INSPECTOR_DETAILED = {
    "Layers": [
        {
            "Name": "Reformatting CopyNode for Input Tensor 0 to /stem/Conv + /stem/Relu",
            "LayerType": "Reformat",
            "Inputs": [{"Name": "images", "Location": "Device", "Dimensions": [1, 3, 224, 224]}],
            "Outputs": [{"Name": "Reformatted Input Tensor 0", "Location": "Device"}],
            "ParameterType": "Reformat",
            "Origin": "REFORMAT",
            "TacticValue": "0x00000000000003e8",
        },
        {"Name": "images to nvm", "LayerType": "Reformat", "ParameterType": "Reformat"},
        {"Name": "{ForeignNode[/stem/Conv.../stage3/Relu]}", "LayerType": "DLA", "ParameterType": "DLA"},
        {"Name": "features from nvm", "LayerType": "Reformat"},
        {"Name": "/head/Gemm", "LayerType": "CaskGemmConvolution", "TacticName": "sm87_xmma_gemm_f16"},
        {"Name": "/head/Softmax", "LayerType": "CaskSoftMaxV2"},
    ],
    "Bindings": ["images", "probs"],
}


def test_inspector_json_detailed() -> None:
    placement = parse_inspector_json(json.dumps(INSPECTOR_DETAILED), dla_requested=True)
    assert placement is not None
    assert [lp.device for lp in placement.layers] == ["gpu", "other", "dla", "other", "gpu", "gpu"]
    assert (placement.dla_layers, placement.gpu_layers) == (1, 3)
    assert placement.layers[4].kind == "CaskGemmConvolution"


def test_inspector_json_names_only() -> None:
    text = json.dumps(
        {"Layers": ["/stem/Conv + /stem/Relu", "{ForeignNode[/blocks.0/attn/MatMul.../blocks.3/Add]}"]}
    )
    on_gpu = parse_inspector_json(text, dla_requested=False)
    assert on_gpu is not None
    assert (on_gpu.dla_layers, on_gpu.gpu_layers) == (0, 2)  # a Myelin region on a GPU build
    on_dla = parse_inspector_json(text, dla_requested=True)
    assert on_dla is not None
    assert (on_dla.dla_layers, on_dla.gpu_layers) == (1, 1)


def test_inspector_separator_characters_are_replaced() -> None:
    text = json.dumps({"Layers": [{"Name": "/a/Conv\x1e/a/Relu", "LayerType": "CaskConvolution"}]})
    placement = parse_inspector_json(text, dla_requested=False)
    assert placement is not None
    assert placement.layers[0].name == "/a/Conv+/a/Relu"


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"Bindings": []}', '{"Layers": "x"}'])
def test_inspector_output_that_is_not_engine_json(text: str) -> None:
    assert parse_inspector_json(text, dla_requested=True) is None


def test_myelin_foreign_nodes_stay_on_the_gpu_even_for_dla_builds() -> None:
    assert classify_inspector_layer("{ForeignNode[/a...b]}", "Myelin", dla_requested=True) == "gpu"
    assert classify_inspector_layer("{ForeignNode[/a...b]}", "", dla_requested=True) == "dla"


def test_combined_placement_counts_from_the_log_layers_from_the_inspector() -> None:
    from_log = parse_placement_log(TRTEXEC_8X_LOG)
    from_inspector = parse_inspector_json(json.dumps(INSPECTOR_DETAILED), dla_requested=True)
    assert from_log is not None
    assert from_inspector is not None
    combined = combine_placement(from_log, from_inspector)
    assert (combined.dla_layers, combined.gpu_layers) == (3, 3)
    assert combined.layers == from_inspector.layers
    assert combined.source == "log+inspector"
    assert combine_placement(None, from_inspector) is from_inspector
    assert combine_placement(from_log, None) is from_log
    assert combine_placement(None, None) == Placement()
    as_dict = combined.as_dict()
    assert set(as_dict) == {"dla_layers", "gpu_layers", "layers", "source"}
    assert as_dict["layers"][2] == {
        "name": "{ForeignNode[/stem/Conv.../stage3/Relu]}",
        "device": "dla",
        "kind": "DLA",
    }


# --- calibrator (no TensorRT needed for the feed and the cache file) ---------------------------


def _batches(n: int, shape: tuple[int, ...]) -> Iterator[npt.NDArray[np.float32]]:
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield rng.standard_normal(shape).astype(np.float32)


def test_feed_maps_single_arrays_to_the_only_input_until_exhausted() -> None:
    feed = CalibrationFeed(_batches(3, (2, 3, 8, 8)), batch_size=2)
    got = [feed.next_feeds(["images"]) for _ in range(5)]
    assert [g is None for g in got] == [False, False, False, True, True]
    first = got[0]
    assert first is not None
    assert first["images"].shape == (2, 3, 8, 8)
    assert first["images"].flags.c_contiguous
    assert feed.batches_served == 3
    assert feed.error is None


def test_feed_takes_mappings_for_multi_input_networks() -> None:
    batch = {"images": np.zeros((1, 3, 4, 4), np.float32), "scale": np.ones((1, 2), np.float32)}
    feed = CalibrationFeed([batch], batch_size=1)
    feeds = feed.next_feeds(["images", "scale"])
    assert feeds is not None
    assert set(feeds) == {"images", "scale"}


@pytest.mark.parametrize(
    ("batches", "names", "message"),
    [
        ([np.zeros((3, 3), np.float32)], ["x"], "first axis must be the batch size 2"),
        ([np.zeros((2, 3), np.float32)], ["x", "y"], "give calibration batches as a mapping"),
        ([{"x": np.zeros((2, 3), np.float32)}], ["x", "y"], r"lacks inputs \['y'\]"),
    ],
)
def test_a_bad_batch_ends_calibration_and_is_recorded(
    batches: list[Any], names: list[str], message: str
) -> None:
    feed = CalibrationFeed(batches, batch_size=2)
    assert feed.next_feeds(names) is None
    assert feed.error is not None
    with pytest.raises(BuildError, match=message):
        raise feed.error
    assert feed.next_feeds(names) is None


def test_a_failing_data_source_is_recorded_not_raised_into_tensorrt() -> None:
    def broken() -> Iterator[npt.NDArray[np.float32]]:
        yield np.zeros((1, 4), np.float32)
        raise OSError("camera vanished")

    feed = CalibrationFeed(broken(), batch_size=1)
    assert feed.next_feeds(["x"]) is not None
    assert feed.next_feeds(["x"]) is None
    assert feed.error is not None
    assert "camera vanished" in str(feed.error)


def test_feed_refuses_a_zero_batch_size() -> None:
    with pytest.raises(BuildError):
        CalibrationFeed([], batch_size=0)


def test_calibration_cache_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "calibration" / "abc.cache"
    assert read_cache_bytes(path) is None
    assert read_cache_bytes(None) is None
    cache = b"TRT-100300-EntropyCalibration2\nimages: 3c010a14\n/stem/Relu_output_0: 3d8b4e7a\n"
    write_cache_bytes(path, cache)
    assert read_cache_bytes(path) == cache
    assert os.listdir(path.parent) == ["abc.cache"]  # no temporary file left behind
    path.write_bytes(b"")
    assert read_cache_bytes(path) is None  # empty means calibrate again
    write_cache_bytes(None, cache)  # no cache path configured: nothing to do


# --- without TensorRT --------------------------------------------------------------------------


@pytest.mark.skipif(_TRT_HERE, reason="TensorRT is installed here")
def test_build_engine_without_tensorrt_is_a_build_error(tmp_path: Path) -> None:
    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(b"")
    with pytest.raises(BuildError, match="TensorRT is not installed"):
        build_engine(onnx_path, _plan(), timing_cache=None, calibration_cache=None, calib_batches=None)


@pytest.mark.skipif(_TRT_HERE, reason="TensorRT is installed here")
def test_calibrator_without_tensorrt_is_a_build_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="TensorRT is not installed"):
        make_entropy_calibrator([], batch_size=1, cache_path=tmp_path / "c.cache")


# --- the small decisions of the build steps ----------------------------------------------------


def test_calibration_batch_size_follows_the_profile_else_the_fixed_batch() -> None:
    shape = ProfileShape("images", (1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))
    assert calibration_batch_size([shape], [("images", [-1, 3, 8, 8])]) == 4
    assert calibration_batch_size([], [("a", [2, 3, 8, 8]), ("b", [6, 4])]) == 6
    assert calibration_batch_size([], [("scalar", []), ("dynamic", [-1, 3])]) == 1
    assert calibration_batch_size([], []) == 1


def test_calibrator_needs_frames_or_an_existing_cache() -> None:
    plan = _plan(precision="int8", int8_mode="calibrator")
    assert calibration_problem(plan, has_batches=False, cache_exists=False) == (
        "INT8 calibration needs calibration frames or an existing calibration cache"
    )
    assert calibration_problem(plan, has_batches=True, cache_exists=False) is None
    assert calibration_problem(plan, has_batches=False, cache_exists=True) is None
    assert calibration_problem(_plan(), has_batches=False, cache_exists=False) is None
    qdq = _plan(precision="int8", int8_mode="qdq")
    assert calibration_problem(qdq, has_batches=False, cache_exists=False) is None


def test_target_label_names_the_dla_core() -> None:
    assert target_label(_plan()) == "gpu fp16"
    assert target_label(_dla_plan(precision="int8", int8_mode="calibrator")) == "dla0 int8"


def test_warning_lines_keep_the_last_warnings_only() -> None:
    log = BuildLog()
    for i in range(60):
        log.add("WARNING", f"w{i}")
        log.add("INFO", f"i{i}")
    log.add("ERROR", "broken")
    warnings = warning_lines(log.text())
    assert len(warnings) == 50
    assert warnings[0] == "[W] w10"
    assert warnings[-1] == "[W] w59"
    assert warning_lines(log.text(), keep=2) == ["[W] w58", "[W] w59"]
