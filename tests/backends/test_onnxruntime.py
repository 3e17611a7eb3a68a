"""ONNX Runtime backend with real models built by onnx.helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from structlog.testing import capture_logs

from agent.backends.base import LoadOptions, get_backend
from agent.backends.onnxruntime import (
    OnnxRuntimeBackend,
    OnnxRuntimeRunner,
    ProviderRequest,
    numpy_dtype,
    optimize_model,
    select_providers,
    small_model_threads,
    split_threads,
)
from agent.demo.modelzoo import write_classifier, write_tiny_classifier
from agent.errors import EngineError
from agent.machine.cpus import usable_cpus
from agent.model_contract.tensors import TensorSpec


def _affine_model(path: Path) -> Path:
    """``y = x * 2 + 1`` and ``n = ReduceSum(x)``: outputs whose values a test can predict exactly."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    total = helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch", 1])
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["doubled"]),
        helper.make_node("Add", ["doubled", "one"], ["y"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=1),
    ]
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    graph = helper.make_graph(nodes, "affine", [x], [y, total], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return path


@pytest.fixture
def affine(tmp_path: Path) -> Path:
    return _affine_model(tmp_path / "affine.onnx")


@pytest.fixture
def runner(affine: Path) -> OnnxRuntimeRunner:
    return OnnxRuntimeBackend().load(affine, LoadOptions())


def test_registry_and_availability() -> None:
    backend = get_backend("onnxruntime")
    assert isinstance(backend, OnnxRuntimeBackend)
    ok, why = backend.available()
    assert ok
    assert "CPUExecutionProvider" in why


def test_load_and_run(runner: OnnxRuntimeRunner) -> None:
    assert runner.inputs == [TensorSpec("x", ("batch", 4), "float32")]
    assert runner.outputs == [
        TensorSpec("y", ("batch", 4), "float32"),
        TensorSpec("total", ("batch", 1), "float32"),
    ]
    assert runner.max_batch is None  # dynamic batch
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = runner.infer({"x": x})
    assert list(out) == ["y", "total"]
    np.testing.assert_array_equal(out["y"], x * 2 + 1)
    np.testing.assert_array_equal(out["total"], x.sum(axis=1, keepdims=True))


def test_describe(runner: OnnxRuntimeRunner, affine: Path) -> None:
    info = runner.describe()
    assert info["backend"] == "onnxruntime"
    assert info["providers"] == ["CPUExecutionProvider"]
    assert info["model"] == str(affine)


def test_missing_provider_skipped_with_warning(affine: Path) -> None:
    options = LoadOptions(providers=("NoSuchExecutionProvider", ("CPUExecutionProvider", {})))
    with capture_logs() as logs:
        runner = OnnxRuntimeBackend().load(affine, options)
    missing = [e for e in logs if e["event"] == "engine.provider.missing"]
    assert [e["provider"] for e in missing] == ["NoSuchExecutionProvider"]
    assert missing[0]["log_level"] == "warning"
    assert runner.describe()["providers"] == ["CPUExecutionProvider"]
    np.testing.assert_array_equal(runner.infer({"x": np.ones((1, 4), np.float32)})["y"], [[3, 3, 3, 3]])


def test_select_providers_keeps_order_and_options() -> None:
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    requested: list[ProviderRequest] = [
        ("CUDAExecutionProvider", {"device_id": "0"}),
        "TensorrtExecutionProvider",
        "ROCMExecutionProvider",
    ]
    with capture_logs() as logs:
        names, options = select_providers(requested, available)
    assert names == ["CUDAExecutionProvider", "TensorrtExecutionProvider", "CPUExecutionProvider"]
    assert options == [{"device_id": "0"}, {}, {}]
    assert [e["provider"] for e in logs] == ["ROCMExecutionProvider"]


def test_cpu_is_last_resort_even_when_nothing_requested_exists(affine: Path) -> None:
    with capture_logs():
        runner = OnnxRuntimeBackend().load(affine, LoadOptions(providers=("CUDAExecutionProvider",)))
    assert runner.describe()["providers"] == ["CPUExecutionProvider"]


def test_intra_op_threads_applied(affine: Path) -> None:
    runner = OnnxRuntimeBackend().load(affine, LoadOptions(intra_op_threads=1))
    assert runner._session.get_session_options().intra_op_num_threads == 1


def test_missing_file_is_engine_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    with pytest.raises(EngineError, match=r"nope\.onnx does not exist"):
        OnnxRuntimeBackend().load(missing, LoadOptions())


def test_invalid_model_is_engine_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf" * 10)
    with pytest.raises(EngineError, match=r"cannot load .*bad\.onnx"):
        OnnxRuntimeBackend().load(bad, LoadOptions())


def test_wrong_input_rank_is_engine_error(runner: OnnxRuntimeRunner) -> None:
    with pytest.raises(EngineError, match="'x' has 3 dimensions, the model expects 2"):
        runner.infer({"x": np.zeros((1, 1, 4), np.float32)})


def test_wrong_dtype_is_engine_error_from_ort(runner: OnnxRuntimeRunner) -> None:
    with pytest.raises(EngineError, match=r"inference failed on affine\.onnx"):
        runner.infer({"x": np.zeros((1, 4), np.float64)})


def test_closed_runner_refuses(runner: OnnxRuntimeRunner) -> None:
    runner.close()
    runner.close()  # idempotent
    assert runner.describe()["providers"] == []
    with pytest.raises(EngineError, match="closed"):
        runner.infer({"x": np.zeros((1, 4), np.float32)})


def test_optimize_model_writes_a_loadable_equivalent(tmp_path: Path) -> None:
    src = write_classifier(tmp_path / "cls.onnx", input_size=32, seed=4)
    dst = optimize_model(src, tmp_path / "engines" / "cls.opt.onnx", ["CPUExecutionProvider"])
    assert dst == tmp_path / "engines" / "cls.opt.onnx"
    assert dst.stat().st_size > 0
    assert [p.name for p in dst.parent.iterdir()] == ["cls.opt.onnx"]  # no temp file left
    backend = OnnxRuntimeBackend()
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    reference = backend.load(src, LoadOptions()).infer({"images": x})["scores"]
    optimized = backend.load(dst, LoadOptions()).infer({"images": x})["scores"]
    np.testing.assert_allclose(optimized, reference, rtol=1e-4, atol=1e-5)


def test_optimize_model_missing_source(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        optimize_model(tmp_path / "none.onnx", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize(
    ("ort_type", "dtype"),
    [
        ("tensor(float)", "float32"),
        ("tensor(float16)", "float16"),
        ("tensor(int64)", "int64"),
        ("tensor(x)", "x"),
    ],
)
def test_numpy_dtype(ort_type: str, dtype: str) -> None:
    assert numpy_dtype(ort_type) == dtype


@pytest.mark.parametrize(
    ("requested", "probe", "cpus", "expected"),
    [
        (0, 0.3, 2, 1),  # a tiny model on a multi-core CPU: one thread, the rest decode frames
        (0, 25.0, 2, None),  # a heavy model keeps ORT's default (every core)
        (0, None, 8, None),  # dynamic input shape: could not measure, keep the default
        (2, 0.3, 8, None),  # the operator chose a thread count: never overridden
        (0, 0.3, 1, None),  # one core: nothing to leave free
    ],
    ids=["tiny", "heavy", "unmeasured", "explicit", "single-core"],
)
def test_small_model_thread_policy(
    requested: int, probe: float | None, cpus: int, expected: int | None
) -> None:
    assert small_model_threads(requested, probe, cpus) == expected


def test_a_tiny_model_loads_with_one_thread_unless_told_otherwise(tmp_path: Path) -> None:
    model = write_tiny_classifier(tmp_path / "tiny.onnx", input_size=32, width=16)
    auto = OnnxRuntimeBackend().load(model, LoadOptions())
    explicit = OnnxRuntimeBackend().load(model, LoadOptions(intra_op_threads=2))
    try:
        # The decision rests on the session's own timed probe, which a loaded machine (8 test workers
        # on 2 cores) can push past the small-model bar: the runner must say what its probe decided.
        assert auto.probe_ms is not None
        if small_model_threads(0, auto.probe_ms, usable_cpus()) == 1:
            assert auto.describe()["intra_op_threads"] == f"1 (auto: {auto.probe_ms:.2f} ms per frame)"
        else:
            assert auto.describe()["intra_op_threads"] == "default"
        assert explicit.describe()["intra_op_threads"] == "2"
        assert explicit.probe_ms is None, "an operator's thread count is not second-guessed by a probe"
        # Only a run on the calling thread alone can be timed by that thread's CPU time.
        assert auto.runs_on_caller is auto.describe()["intra_op_threads"].startswith("1 ")
        assert explicit.runs_on_caller is False
        x = np.zeros((2, 3, 32, 32), np.float32)
        np.testing.assert_allclose(
            auto.infer({"images": x})["scores"], explicit.infer({"images": x})["scores"], rtol=1e-5
        )
    finally:
        auto.close()
        explicit.close()


@pytest.mark.parametrize(
    ("requested", "cpus", "parallel_runs", "expected"),
    [
        (0, 2, 1, 0),  # one run at a time: ORT's default (every core)
        (0, 2, 2, 1),  # two runs side by side on two cores: one thread each
        (0, 8, 2, 4),
        (0, 2, 4, 1),  # never fewer than one
        (3, 8, 4, 3),  # the operator's number wins
    ],
)
def test_runs_side_by_side_share_the_cores(
    requested: int, cpus: int, parallel_runs: int, expected: int
) -> None:
    assert split_threads(requested, cpus, parallel_runs) == expected


def test_a_load_for_parallel_runs_takes_its_share_and_reports_its_measured_run_time(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "m.onnx", input_size=32, num_classes=4)
    runner = OnnxRuntimeBackend().load(model, LoadOptions(parallel_runs=64))
    explicit = OnnxRuntimeBackend().load(model, LoadOptions(intra_op_threads=1))
    try:
        assert runner.describe()["intra_op_threads"].startswith("1 (auto: 64 runs side by side")
        assert runner.probe_ms is not None
        assert runner.probe_ms > 0.0
        assert explicit.probe_ms is None  # a chosen thread count needs no measurement
        assert (runner.runs_on_caller, explicit.runs_on_caller) == (True, True)
    finally:
        runner.close()
        explicit.close()
