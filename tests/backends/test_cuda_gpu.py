"""CUDA memory and streams through cuda-python (agent.backends.cuda).

Tests marked ``gpu`` need a CUDA GPU and cuda-python; they are deselected by default and run with
``make gpu-test`` (``pytest -m gpu``) on a CUDA machine (see docs/gpu.md). The unmarked tests run
everywhere: the missing-cuda-python path, the error conversion, and the host-side array views.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.backends import cuda
from agent.errors import EngineError
from tests.waiting import patient


def _cuda_python_installed() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None or (
            importlib.util.find_spec("cuda") is not None
            and importlib.util.find_spec("cuda.cudart") is not None
        )
    except (ImportError, ValueError):
        return False


# --- everywhere --------------------------------------------------------------------------------


@pytest.mark.skipif(_cuda_python_installed(), reason="cuda-python is installed here")
def test_without_cuda_python_every_entry_point_says_how_to_install_it() -> None:
    ok, why = cuda.cuda_status()
    assert not ok
    assert "cuda-python not installed" in why
    assert "pip install" in why
    with pytest.raises(EngineError, match="cuda-python not installed"):
        cuda.DeviceBuffer(16)
    with pytest.raises(EngineError, match="cuda-python not installed"):
        cuda.Stream()
    with pytest.raises(EngineError, match="cuda-python not installed"):
        cuda.mem_get_info()


class _FakeError(int):
    """Stands in for cuda-python's ``cudaError_t`` enum members."""


def _fake_runtime() -> SimpleNamespace:
    """A stand-in for the cuda-python runtime module: only what :func:`cuda.check` touches.

    It is a fake because there is no CUDA here; the real module is exercised by the gpu tests.
    """
    success = _FakeError(0)
    names = {0: b"cudaSuccess", 2: b"cudaErrorMemoryAllocation", 35: b"cudaErrorInsufficientDriver"}
    return SimpleNamespace(
        cudaError_t=SimpleNamespace(cudaSuccess=success),
        cudaGetErrorName=lambda err: (success, names[int(err)]),
    )


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    rt = _fake_runtime()
    monkeypatch.setattr(cuda, "_runtime_module", rt)
    return rt


def test_check_returns_the_values_after_a_success(fake_runtime: SimpleNamespace) -> None:
    assert cuda.check((_FakeError(0), 123, 456), "cudaMemGetInfo") == (123, 456)
    assert cuda.check((_FakeError(0),), "cudaFree") == ()


def test_check_turns_a_failure_into_an_engine_error_with_the_cuda_name(fake_runtime: SimpleNamespace) -> None:
    with pytest.raises(EngineError, match=r"cudaMalloc\(1024\) failed: cudaErrorMemoryAllocation"):
        cuda.check((_FakeError(2), 0), "cudaMalloc(1024)")
    with pytest.raises(EngineError, match="cudaErrorInsufficientDriver"):
        cuda.check((_FakeError(35), 0), "cudaGetDeviceCount")


@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        ((2, 3), np.float32, 24),
        ((4,), np.float16, 8),
        ((1, 3, 224, 224), np.uint8, 150528),
        ((0, 5), np.int64, 0),
    ],
)
def test_nbytes_of(shape: tuple[int, ...], dtype: Any, expected: int) -> None:
    assert cuda.nbytes_of(shape, dtype) == expected


def test_nbytes_of_refuses_a_negative_dimension() -> None:
    with pytest.raises(EngineError, match="negative"):
        cuda.nbytes_of((-1, 3), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int64])
def test_host_view_is_a_writable_window_onto_the_raw_memory(dtype: Any) -> None:
    # Plain ctypes memory stands in for pinned memory: the view logic is the same.
    shape = (3, 5)
    raw = ctypes.create_string_buffer(cuda.nbytes_of(shape, dtype))
    view = cuda._host_view(ctypes.addressof(raw), shape, dtype)
    assert view.shape == shape
    assert view.dtype == np.dtype(dtype)
    view[...] = np.arange(15, dtype=dtype).reshape(shape)
    again = cuda._host_view(ctypes.addressof(raw), shape, dtype)
    np.testing.assert_array_equal(again, np.arange(15, dtype=dtype).reshape(shape))
    assert bytes(raw.raw) == np.arange(15, dtype=dtype).tobytes()


# --- on a CUDA machine -------------------------------------------------------------------------


@pytest.fixture
def gpu() -> None:
    """Fail (not skip) when CUDA is unusable: ``-m gpu`` was asked for on purpose."""
    ok, why = cuda.cuda_status()
    if not ok:
        pytest.fail(f"gpu tests need CUDA and cuda-python: {why}")
    cuda.set_device(0)


def _random(shape: tuple[int, ...], dtype: Any, seed: int) -> npt.NDArray[Any]:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int8, np.int32, np.int64])
@pytest.mark.parametrize("shape", [(1,), (1000,), (1, 3, 224, 224), (4, 1 << 18)])
def test_round_trip_through_pinned_buffers_and_a_non_blocking_stream(
    shape: tuple[int, ...], dtype: Any
) -> None:
    data = _random(shape, dtype, seed=sum(shape))
    with (
        cuda.PinnedBuffer(shape, dtype) as src,
        cuda.PinnedBuffer(shape, dtype) as dst,
        cuda.DeviceBuffer(data.nbytes) as dev,
        cuda.Stream() as stream,
    ):
        src.array[...] = data
        dst.array[...] = 0
        cuda.copy_htod_async(dev, src.array, stream)
        cuda.copy_dtoh_async(dst.array, dev, stream)
        stream.synchronize()
        np.testing.assert_array_equal(dst.array, data)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_a_thousand_allocate_copy_free_cycles_do_not_leak_device_memory() -> None:
    nbytes = 1 << 20
    data = _random((nbytes // 4,), np.float32, seed=7)

    def cycle(stream: cuda.Stream) -> None:
        with cuda.DeviceBuffer(nbytes) as dev, cuda.PinnedBuffer(data.shape, data.dtype) as host:
            cuda.copy_htod_async(dev, data, stream)
            cuda.copy_dtoh_async(host.array, dev, stream)
            stream.synchronize()
            assert host.array[17] == data[17]

    with cuda.Stream() as stream:
        cycle(stream)  # first touch: lets the allocator and context settle before measuring
        free_before, total = cuda.mem_get_info()
        for _ in range(1000):
            cycle(stream)
        free_after, _ = cuda.mem_get_info()
    leaked = free_before - free_after
    print(
        f"device memory: total {total / 2**20:.0f} MiB, free before {free_before / 2**20:.1f} MiB, "
        f"after 1000 cycles {free_after / 2**20:.1f} MiB, difference {leaked / 2**20:.2f} MiB"
    )
    # 1000 leaked 1 MiB buffers would be ~1000 MiB; allow 8 MiB of allocator noise.
    assert leaked < 8 * 2**20


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_two_threads_with_their_own_streams_do_not_mix_their_data() -> None:
    errors: list[BaseException] = []
    checked = [0, 0]

    def worker(index: int) -> None:
        try:
            cuda.ensure_device(0)  # current device is per thread
            shape = (64, 1024)
            with (
                cuda.Stream() as stream,
                cuda.DeviceBuffer(cuda.nbytes_of(shape, np.float32)) as dev,
                cuda.PinnedBuffer(shape, np.float32) as src,
                cuda.PinnedBuffer(shape, np.float32) as dst,
            ):
                for step in range(50):
                    src.array[...] = index * 1000 + step
                    cuda.copy_htod_async(dev, src.array, stream)
                    cuda.copy_dtoh_async(dst.array, dev, stream)
                    stream.synchronize()
                    assert np.all(dst.array == index * 1000 + step), f"thread {index} step {step}"
                    checked[index] += 1
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"cuda-worker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=patient(60))
    assert not any(t.is_alive() for t in threads), "a CUDA worker thread hung"
    assert not errors, errors
    assert checked == [50, 50]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_mapped_buffer_is_zero_copy_both_ways() -> None:
    if not cuda.can_map_host_memory(0):
        pytest.skip("this GPU cannot map host memory")
    shape = (256, 256)
    data = _random(shape, np.float32, seed=3)
    with (
        cuda.MappedBuffer(shape, np.float32) as mapped,
        cuda.PinnedBuffer(shape, np.float32) as out,
        cuda.Stream() as stream,
    ):
        assert mapped.device_ptr != 0
        # CPU writes, the GPU reads through the device pointer: no host-to-device copy involved.
        mapped.array[...] = data
        cuda.copy_dtoh_async(out.array, mapped.device_ptr, stream)
        stream.synchronize()
        np.testing.assert_array_equal(out.array, data)
        # The GPU writes through the device pointer, the CPU sees it in the same memory.
        cuda.copy_htod_async(mapped.device_ptr, (data * 2).astype(np.float32), stream)
        stream.synchronize()
        np.testing.assert_array_equal(mapped.array, data * 2)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_free_is_idempotent_and_use_after_free_is_an_engine_error() -> None:
    dev = cuda.DeviceBuffer(64)
    host = cuda.PinnedBuffer((16,), np.float32)
    stream = cuda.Stream()
    for _ in range(2):
        dev.free()
        host.free()
        stream.destroy()
    assert dev.freed
    with pytest.raises(EngineError, match="freed"):
        _ = dev.ptr
    with pytest.raises(EngineError, match="freed"):
        _ = host.array
    with pytest.raises(EngineError, match="destroyed"):
        stream.synchronize()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_copies_that_do_not_fit_are_refused_before_reaching_cuda() -> None:
    with cuda.DeviceBuffer(16) as dev, cuda.Stream() as stream:
        with pytest.raises(EngineError, match="does not fit"):
            cuda.copy_htod_async(dev, np.zeros(8, np.float32), stream)
        with pytest.raises(EngineError, match="reads past"):
            cuda.copy_dtoh_async(np.zeros(8, np.float32), dev, stream)
        with pytest.raises(EngineError, match="C-contiguous"):
            cuda.copy_htod_async(dev, np.zeros((4, 4), np.float32)[:, :1], stream)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_a_cuda_failure_is_an_engine_error_named_by_cuda() -> None:
    _, total = cuda.mem_get_info()
    with pytest.raises(EngineError, match=r"cudaMalloc\(\d+\) failed: cudaError"):
        cuda.DeviceBuffer(total * 4)
