"""TensorRT backend: the pure helpers everywhere, the runner's buffer handling on a CUDA machine.

There is no TensorRT here (only its type stubs, which make ``import tensorrt`` succeed as an empty
namespace package). The ``gpu`` tests drive :class:`TensorRTRunner` with a fake engine whose
"execution" is a real CUDA device-to-device copy, so the runner's pinned/device buffers, stream,
per-thread contexts and re-allocation policy run against real CUDA memory.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from agent.backends import cuda
from agent.backends.base import LoadOptions, get_backend
from agent.backends.tensorrt import (
    TensorRTBackend,
    TensorRTRunner,
    device_label,
    dims_to_shape,
    numpy_dtype_name,
    parse_dla_core,
    required_capacity,
    resolve_input_shape,
)
from agent.backends.trt_api import tensorrt_status, trt_major
from agent.errors import EngineError
from agent.model_contract.tensors import TensorSpec
from tests.waiting import patient

# --- pure helpers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trt_name", "numpy_name"),
    [
        ("FLOAT", "float32"),
        ("HALF", "float16"),
        ("INT8", "int8"),
        ("INT32", "int32"),
        ("INT64", "int64"),
        ("BOOL", "bool"),
        ("UINT8", "uint8"),
    ],
)
def test_trt_dtypes_map_to_numpy(trt_name: str, numpy_name: str) -> None:
    assert numpy_dtype_name(trt_name) == numpy_name
    assert np.dtype(numpy_name).name == numpy_name


@pytest.mark.parametrize("trt_name", ["BF16", "FP8", "FP4", "INT4"])
def test_trt_dtypes_without_numpy_equivalent_are_refused_with_a_fix(trt_name: str) -> None:
    with pytest.raises(EngineError, match=f"{trt_name} has no numpy equivalent.*rebuild"):
        numpy_dtype_name(trt_name)


def test_dynamic_dims_become_none() -> None:
    assert dims_to_shape([-1, 3, 224, 224]) == (None, 3, 224, 224)
    assert dims_to_shape([1, -1, -1, 3]) == (1, None, None, 3)
    assert dims_to_shape([]) == ()


def test_resolve_input_shape_accepts_any_size_on_dynamic_axes() -> None:
    assert resolve_input_shape("images", (None, 3, None, None), (4, 3, 320, 480)) == (4, 3, 320, 480)


def test_resolve_input_shape_checks_the_batch_axis_of_a_static_engine() -> None:
    # Runner.infer skips axis 0; a static TensorRT engine cannot run another batch size.
    with pytest.raises(EngineError, match=r"axis 0 is 8, the engine was built for 1.*shape profile"):
        resolve_input_shape("images", (1, 3, 224, 224), (8, 3, 224, 224))


def test_resolve_input_shape_checks_rank_and_fixed_axes() -> None:
    with pytest.raises(EngineError, match="3 dimensions, the engine expects 4"):
        resolve_input_shape("images", (1, 3, 224, 224), (3, 224, 224))
    with pytest.raises(EngineError, match="axis 1 is 1"):
        resolve_input_shape("images", (None, 3, 224, 224), (2, 1, 224, 224))


@pytest.mark.parametrize(
    ("current", "needed", "expected"),
    [(0, 100, 100), (100, 100, None), (100, 40, None), (100, 101, 101), (0, 0, None)],
)
def test_buffers_grow_only_when_the_batch_needs_more(current: int, needed: int, expected: int | None) -> None:
    assert required_capacity(current, needed) == expected


def test_required_capacity_refuses_negative_sizes() -> None:
    with pytest.raises(EngineError):
        required_capacity(10, -1)


def test_device_label_and_dla_core_option() -> None:
    assert device_label(None) == "gpu"
    assert device_label(1) == "dla1"
    assert parse_dla_core(None) is None
    assert parse_dla_core(0) == 0
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(EngineError, match="dla_core"):
            parse_dla_core(bad)


def test_trt_major() -> None:
    assert trt_major("10.3.0.30") == 10
    assert trt_major("8.5.2.2") == 8
    with pytest.raises(EngineError):
        trt_major("unknown")


# --- availability here -------------------------------------------------------------------------


_TRT_HERE = tensorrt_status()[0]


@pytest.mark.skipif(_TRT_HERE, reason="TensorRT is installed here")
def test_tensorrt_is_reported_unavailable_here_with_the_reason() -> None:
    ok, why = tensorrt_status()
    assert not ok
    assert "TensorRT is not installed" in why
    backend = get_backend("tensorrt")
    assert isinstance(backend, TensorRTBackend)
    ok, why = backend.available()
    assert not ok
    assert "TensorRT" in why


@pytest.mark.skipif(_TRT_HERE, reason="TensorRT is installed here")
def test_load_without_tensorrt_is_an_engine_error_with_the_same_reason(tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    engine.write_bytes(b"not a plan")
    with pytest.raises(EngineError, match="TensorRT is not installed"):
        TensorRTBackend().load(engine, LoadOptions(extra={"dla_core": 0}))


# --- runner on real CUDA memory with a fake engine ---------------------------------------------


class _FakeContext:
    """Stands in for ``trt.IExecutionContext`` (no TensorRT here).

    ``execute_async_v3`` copies the input tensor's device memory to the output's on the given
    stream, through the real CUDA runtime: output = input, so the runner's copies are checked.
    """

    def __init__(self, engine: _FakeEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if shape[0] > self.engine.max_batch:
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> list[int]:
        return list(self.shapes.get("in", self.engine.static_shape))

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        if self.engine.fail_execute:
            return False
        rt = cuda.runtime()
        shape = self.shapes.get("in", self.engine.static_shape)
        nbytes = cuda.nbytes_of(shape, np.float32)
        cuda.check(
            rt.cudaMemcpyAsync(
                self.addresses["out"],
                self.addresses["in"],
                nbytes,
                rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                stream_handle,
            ),
            "fake execute",
        )
        return True


class _FakeEngine:
    """Stands in for ``trt.ICudaEngine``: counts the contexts it creates."""

    def __init__(self, static_shape: tuple[int, ...] = (2, 8), max_batch: int = 64) -> None:
        self.static_shape = static_shape
        self.max_batch = max_batch
        self.contexts: list[_FakeContext] = []
        self.fail_execute = False
        self.lock = threading.Lock()

    def create_execution_context(self) -> _FakeContext:
        with self.lock:
            ctx = _FakeContext(self)
            self.contexts.append(ctx)
            return ctx


def _runner(engine: _FakeEngine, *, dynamic: bool) -> TensorRTRunner:
    batch: int | None = None if dynamic else engine.static_shape[0]
    return TensorRTRunner(
        cast(Any, object()),
        cast(Any, engine),
        cast(Any, object()),
        [TensorSpec("in", (batch, 8), "float32")],
        [TensorSpec("out", (batch, 8), "float32")],
        dla_core=None,
        precision="fp16",
        placement={"dla_layers": 0, "gpu_layers": 3},
    )


@pytest.fixture
def gpu() -> None:
    ok, why = cuda.cuda_status()
    if not ok:
        pytest.fail(f"gpu tests need CUDA and cuda-python: {why}")


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_runner_round_trips_and_grows_buffers_only_for_larger_batches() -> None:
    engine = _FakeEngine()
    runner = _runner(engine, dynamic=True)
    try:
        capacities = []
        for batch in (4, 2, 4, 16, 3):
            x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
            out = runner.infer({"in": x})["out"]
            np.testing.assert_array_equal(out, x)
            state = runner._local.state
            capacities.append(state.buffers["in"].capacity)
        assert capacities == [128, 128, 128, 512, 512]
        assert len(engine.contexts) == 1, "one context per thread, never one per batch"
        assert runner.describe() == {
            "backend": "tensorrt",
            "device": "gpu",
            "precision": "fp16",
            "placement": {"dla_layers": 0, "gpu_layers": 3},
        }
    finally:
        runner.close()
    with pytest.raises(EngineError, match="closed"):
        runner.infer({"in": np.zeros((1, 8), np.float32)})


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_runner_outputs_are_copies_not_views_of_reused_pinned_memory() -> None:
    runner = _runner(_FakeEngine(), dynamic=True)
    try:
        first = runner.infer({"in": np.full((2, 8), 1.0, np.float32)})["out"]
        runner.infer({"in": np.full((2, 8), 2.0, np.float32)})
        assert np.all(first == 1.0)
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_runner_reports_shapes_outside_the_profile_and_failed_execution() -> None:
    engine = _FakeEngine(max_batch=4)
    runner = _runner(engine, dynamic=True)
    try:
        with pytest.raises(EngineError, match="outside the engine's optimisation profile"):
            runner.infer({"in": np.zeros((5, 8), np.float32)})
        engine.fail_execute = True
        with pytest.raises(EngineError, match="execute_async_v3 failed"):
            runner.infer({"in": np.zeros((2, 8), np.float32)})
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_static_runner_refuses_another_batch_size() -> None:
    runner = _runner(_FakeEngine(static_shape=(2, 8)), dynamic=False)
    try:
        np.testing.assert_array_equal(runner.infer({"in": np.ones((2, 8), np.float32)})["out"], 1.0)
        with pytest.raises(EngineError, match="axis 0 is 3"):
            runner.infer({"in": np.ones((3, 8), np.float32)})
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_each_thread_gets_its_own_context_and_keeps_it() -> None:
    engine = _FakeEngine()
    runner = _runner(engine, dynamic=True)
    errors: list[BaseException] = []

    def worker(value: float) -> None:
        try:
            for _ in range(20):
                out = runner.infer({"in": np.full((3, 8), value, np.float32)})["out"]
                assert np.all(out == value)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(float(i),), name=f"infer-{i}") for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=patient(60))
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert len(engine.contexts) == 3
    finally:
        runner.close()
    assert runner._states == []


# --- inputs already in device memory (GPU preprocessing) ----------------------------------------


class _CudaArray:
    """An object speaking ``__cuda_array_interface__`` (what CuPy and PyTorch arrays expose)."""

    def __init__(
        self, ptr: int, shape: tuple[int, ...], typestr: str, strides: tuple[int, ...] | None
    ) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


def test_device_array_reads_the_cuda_array_interface() -> None:
    assert cuda.device_array(np.zeros((2, 3), np.float32)) is None
    dense = cuda.device_array(_CudaArray(4096, (2, 3, 4), "<f2", None))
    assert dense == cuda.DeviceArray(4096, (2, 3, 4), "float16")
    explicit = cuda.device_array(_CudaArray(4096, (2, 3, 4), "|u1", (12, 4, 1)))
    assert explicit == cuda.DeviceArray(4096, (2, 3, 4), "uint8")


def test_device_array_refuses_strided_views_and_malformed_interfaces() -> None:
    with pytest.raises(EngineError, match="not C-contiguous"):
        cuda.device_array(_CudaArray(4096, (2, 3), "<f4", (4, 8)))
    broken = _CudaArray(4096, (2, 3), "<f4", None)
    del broken.__cuda_array_interface__["data"]
    with pytest.raises(EngineError, match="malformed __cuda_array_interface__ on a _CudaArray"):
        cuda.device_array(broken)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_runner_takes_a_device_tensor_as_its_input_buffer_without_a_host_copy() -> None:
    """GPU preprocessing's tensor is the engine's input: its address is set, nothing is staged."""
    import cupy  # the GPU preprocessing feed is a CuPy array; missing CuPy fails (-m gpu was asked for)

    engine = _FakeEngine()
    runner = _runner(engine, dynamic=True)
    try:
        x = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
        feed = cupy.asarray(x)
        cupy.cuda.runtime.deviceSynchronize()
        out = runner.infer({"in": cast(Any, feed)})["out"]
        np.testing.assert_array_equal(out, x)
        (context,) = engine.contexts
        assert context.addresses["in"] == feed.data.ptr, "the engine reads the device tensor in place"
        assert "in" not in runner._local.state.buffers, "no pinned or device staging buffer for the input"
        with pytest.raises(EngineError, match="is a float16 device array, the engine expects float32"):
            runner.infer({"in": cast(Any, feed.astype(cupy.float16))})
    finally:
        runner.close()
