"""CUDA device memory, pinned host memory and streams through cuda-python, for TensorRT.

cuda-python is imported lazily (``from cuda.bindings import runtime``; cuda-python 12.x before 12.6
only has ``from cuda import cudart``), so this module imports on any machine; the first call that
needs CUDA raises :class:`~agent.errors.EngineError` with the reason when cuda-python is missing.

Every cuda-python call returns ``(cudaError_t, *values)``. :func:`check` turns a failure into an
``EngineError`` named with ``cudaGetErrorName``; the small classes here keep cuda-python's untyped
objects inside this module and hand out plain ints (device pointers, stream handles) and numpy views.

Buffers are freed explicitly (``free()`` / ``destroy()`` / ``with``), never from ``__del__``: a
finaliser that runs during interpreter shutdown can call into an already unloaded CUDA library.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.errors import EngineError

#: The file every Jetson's L4T has (agent.machine.platform reads the release from it).
_L4T_RELEASE = Path("/etc/nv_tegra_release")


def install_hint(jetson: bool | None = None) -> str:
    """What to install to use CUDA, for this kind of machine (``jetson`` None: look at this one).

    On a Jetson the CUDA comes with JetPack; elsewhere (an x86 workstation, a CI runner) JetPack
    means nothing, and without an NVIDIA GPU no install helps.
    """
    if jetson is None:
        jetson = _L4T_RELEASE.exists()
    if jetson:
        return "install cuda-python matching the CUDA of this JetPack: pip install 'cuda-python>=12,<13'"
    return (
        "on a machine with an NVIDIA GPU, install cuda-python for its CUDA driver's major version "
        "(nvidia-smi shows it): pip install 'cuda-python>=12,<13'; without an NVIDIA GPU, CUDA does "
        "not apply here"
    )


_runtime_module: ModuleType | None = None
_runtime_lock = threading.Lock()
_thread_device = threading.local()


def runtime() -> ModuleType:
    """The cuda-python runtime module (``cudart``), imported on first use.

    Raises :class:`EngineError` when cuda-python is not installed.
    """
    global _runtime_module  # noqa: PLW0603 - one lazily imported module per process
    with _runtime_lock:
        if _runtime_module is None:
            _runtime_module = _import_runtime()
        return _runtime_module


def _import_runtime() -> ModuleType:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            # The old location, the only one before 12.6 and gone in 13.0.
            from cuda import cudart
        except ImportError as exc:
            raise EngineError(f"cuda-python not installed: {install_hint()}") from exc
    module: ModuleType = cudart
    return module


def cuda_status() -> tuple[bool, str]:
    """Whether CUDA can be used here (cuda-python present, a driver, at least one GPU), and why not."""
    try:
        count = device_count()
    except EngineError as exc:
        return False, str(exc)
    if count < 1:
        return False, "no CUDA device found"
    return True, f"{count} CUDA device(s)"


def check(result: Any, what: str) -> tuple[Any, ...]:
    """Check a cuda-python ``(err, *values)`` result; return the values or raise :class:`EngineError`.

    ``what`` names the call for the message, e.g. ``"cudaMalloc(1048576)"``.
    """
    values: tuple[Any, ...] = tuple(result) if isinstance(result, tuple) else (result,)
    err = values[0]
    rt = runtime()
    if err == rt.cudaError_t.cudaSuccess:
        return values[1:]
    raise EngineError(f"{what} failed: {error_name(err)}")


def error_name(err: Any) -> str:
    """``cudaGetErrorName`` of ``err`` as text (falls back to ``repr`` when even that fails)."""
    rt = runtime()
    try:
        got = rt.cudaGetErrorName(err)
        name = got[1] if isinstance(got, tuple) else got
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - only used to word an error message
        return repr(err)


def _as_int(value: Any) -> int:
    """A pointer or handle from cuda-python as a plain int (they define ``__int__``)."""
    return int(value)


def device_count() -> int:
    """Number of CUDA devices visible to this process."""
    (count,) = check(runtime().cudaGetDeviceCount(), "cudaGetDeviceCount")
    return _as_int(count)


def set_device(device: int = 0) -> None:
    """Make ``device`` current for the calling thread (``cudaSetDevice``).

    CUDA's current device is per thread: every worker thread that touches CUDA calls this (or
    :func:`ensure_device`) first.
    """
    check(runtime().cudaSetDevice(device), f"cudaSetDevice({device})")
    _thread_device.device = device


def ensure_device(device: int = 0) -> None:
    """:func:`set_device` once per thread; later calls from the same thread cost nothing."""
    if getattr(_thread_device, "device", None) != device:
        set_device(device)


def mem_get_info() -> tuple[int, int]:
    """``(free, total)`` bytes of device memory (``cudaMemGetInfo``)."""
    free, total = check(runtime().cudaMemGetInfo(), "cudaMemGetInfo")
    return _as_int(free), _as_int(total)


def can_map_host_memory(device: int = 0) -> bool:
    """Whether ``device`` can map pinned host memory into its address space (zero-copy)."""
    rt = runtime()
    (value,) = check(
        rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrCanMapHostMemory, device),
        "cudaDeviceGetAttribute(CanMapHostMemory)",
    )
    return bool(value)


def nbytes_of(shape: Sequence[int], dtype: npt.DTypeLike) -> int:
    """Bytes needed by an array of ``shape`` and ``dtype``."""
    if any(d < 0 for d in shape):
        raise EngineError(f"cannot size a buffer for shape {tuple(shape)}: negative dimension")
    return math.prod(shape) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class DeviceArray:
    """A C-contiguous array in device memory, as its ``__cuda_array_interface__`` describes it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name


def device_array(obj: object) -> DeviceArray | None:
    """``obj``'s device memory when it is a CUDA array (CuPy, PyTorch, Numba), None for a host array.

    Reads the ``__cuda_array_interface__`` protocol (version 2+) without importing the library
    that made ``obj``. Refuses strided views: the engine reads its input as one dense block.
    """
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None:
        return None
    try:
        shape = tuple(int(d) for d in iface["shape"])
        dtype = np.dtype(iface["typestr"])
        ptr = int(iface["data"][0])
        strides = iface.get("strides")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"malformed __cuda_array_interface__ on a {type(obj).__name__}: {exc}") from exc
    if strides is not None and tuple(int(s) for s in strides) != _c_strides(shape, dtype.itemsize):
        raise EngineError(
            f"device array of shape {shape} is not C-contiguous; the engine needs a dense input"
        )
    return DeviceArray(ptr, shape, dtype.name)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides: list[int] = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _host_view(ptr: int, shape: Sequence[int], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A writable numpy array over ``nbytes_of(shape, dtype)`` bytes of host memory at ``ptr``."""
    nbytes = nbytes_of(shape, dtype)
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    flat: npt.NDArray[np.uint8] = np.ctypeslib.as_array(raw)[:nbytes]
    return flat.view(np.dtype(dtype)).reshape(tuple(shape))


class DeviceBuffer:
    """``nbytes`` of device memory (``cudaMalloc``); ``free()`` is idempotent; a context manager."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise EngineError(f"cannot allocate {nbytes} bytes of device memory")
        self.nbytes = nbytes
        # cudaMalloc(0) may return a null pointer, which TensorRT rejects as a tensor address.
        (ptr,) = check(runtime().cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})")
        self._ptr: int | None = _as_int(ptr)

    @property
    def ptr(self) -> int:
        """The device pointer; raises :class:`EngineError` after :meth:`free`."""
        if self._ptr is None:
            raise EngineError("device buffer used after it was freed")
        return self._ptr

    @property
    def freed(self) -> bool:
        return self._ptr is None

    def free(self) -> None:
        """Release the memory (``cudaFree``). Idempotent."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            check(runtime().cudaFree(ptr), "cudaFree")

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.free()


class PinnedBuffer:
    """Page-locked host memory (``cudaMallocHost``) seen as a numpy array of ``shape`` and ``dtype``.

    Copies between pinned memory and the device run truly asynchronously on a stream; from pageable
    memory the driver stages them synchronously. The array view dangles after :meth:`free`: drop
    references to it first.
    """

    def __init__(self, shape: Sequence[int], dtype: npt.DTypeLike) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = nbytes_of(self.shape, self.dtype)
        (ptr,) = check(runtime().cudaMallocHost(max(self.nbytes, 1)), f"cudaMallocHost({self.nbytes})")
        self._ptr: int | None = _as_int(ptr)
        self._array: npt.NDArray[Any] | None = _host_view(self._ptr, self.shape, self.dtype)

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            raise EngineError("pinned buffer used after it was freed")
        return self._ptr

    @property
    def array(self) -> npt.NDArray[Any]:
        """The numpy view of the buffer (writable)."""
        if self._array is None:
            raise EngineError("pinned buffer used after it was freed")
        return self._array

    def free(self) -> None:
        """Release the memory (``cudaFreeHost``). Idempotent."""
        ptr, self._ptr, self._array = self._ptr, None, None
        if ptr is not None:
            check(runtime().cudaFreeHost(ptr), "cudaFreeHost")

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.free()


class MappedBuffer:
    """Pinned host memory mapped into the device address space (zero-copy).

    ``cudaHostAlloc(cudaHostAllocMapped)`` + ``cudaHostGetDevicePointer``: on Jetson (Orin) the CPU
    and GPU share the same DRAM, so a kernel reading :attr:`device_ptr` reads the very bytes the CPU
    wrote to :attr:`array`, with no copy. On a discrete GPU the reads cross PCIe on every access.
    Check :func:`can_map_host_memory` first.
    """

    def __init__(self, shape: Sequence[int], dtype: npt.DTypeLike) -> None:
        rt = runtime()
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = nbytes_of(self.shape, self.dtype)
        (host,) = check(
            rt.cudaHostAlloc(max(self.nbytes, 1), rt.cudaHostAllocMapped), f"cudaHostAlloc({self.nbytes})"
        )
        self._ptr: int | None = _as_int(host)
        try:
            (device,) = check(rt.cudaHostGetDevicePointer(self._ptr, 0), "cudaHostGetDevicePointer")
        except EngineError:
            self.free()
            raise
        self.device_ptr = _as_int(device)
        self._array: npt.NDArray[Any] | None = _host_view(self._ptr, self.shape, self.dtype)

    @property
    def ptr(self) -> int:
        """Host pointer."""
        if self._ptr is None:
            raise EngineError("mapped buffer used after it was freed")
        return self._ptr

    @property
    def array(self) -> npt.NDArray[Any]:
        if self._array is None:
            raise EngineError("mapped buffer used after it was freed")
        return self._array

    def free(self) -> None:
        """Release the memory (``cudaFreeHost``). Idempotent."""
        ptr, self._ptr, self._array = self._ptr, None, None
        if ptr is not None:
            check(runtime().cudaFreeHost(ptr), "cudaFreeHost")

    def __enter__(self) -> MappedBuffer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.free()


class Stream:
    """A non-blocking CUDA stream (does not synchronise with the legacy default stream)."""

    def __init__(self) -> None:
        rt = runtime()
        (stream,) = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self._stream: Any = stream
        self.handle = _as_int(stream)

    @property
    def raw(self) -> Any:
        """The cuda-python ``cudaStream_t`` (for cuda-python calls); raises after :meth:`destroy`."""
        if self._stream is None:
            raise EngineError("CUDA stream used after it was destroyed")
        return self._stream

    def synchronize(self) -> None:
        """Wait until all work queued on the stream has finished."""
        check(runtime().cudaStreamSynchronize(self.raw), "cudaStreamSynchronize")

    def destroy(self) -> None:
        """Destroy the stream. Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            check(runtime().cudaStreamDestroy(stream), "cudaStreamDestroy")

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()


def _device_ptr(dst: DeviceBuffer | int) -> int:
    return dst.ptr if isinstance(dst, DeviceBuffer) else int(dst)


def _contiguous_nbytes(array: npt.NDArray[Any], role: str) -> int:
    if not array.flags.c_contiguous:
        raise EngineError(f"{role} array must be C-contiguous for a CUDA copy")
    return int(array.nbytes)


def copy_htod_async(dst: DeviceBuffer | int, src: npt.NDArray[Any], stream: Stream) -> None:
    """Queue a host-to-device copy of all of ``src`` to ``dst`` on ``stream``.

    ``src`` must stay alive and unchanged until the stream is synchronised; it should be a
    :class:`PinnedBuffer` view for the copy to overlap with other work.
    """
    rt = runtime()
    nbytes = _contiguous_nbytes(src, "source")
    if isinstance(dst, DeviceBuffer) and nbytes > dst.nbytes:
        raise EngineError(f"copy of {nbytes} bytes does not fit a device buffer of {dst.nbytes}")
    check(
        rt.cudaMemcpyAsync(
            _device_ptr(dst), src.ctypes.data, nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.raw
        ),
        "cudaMemcpyAsync(host to device)",
    )


def copy_dtoh_async(dst: npt.NDArray[Any], src: DeviceBuffer | int, stream: Stream) -> None:
    """Queue a device-to-host copy filling all of ``dst`` from ``src`` on ``stream``.

    ``dst`` holds the data only after :meth:`Stream.synchronize`.
    """
    rt = runtime()
    nbytes = _contiguous_nbytes(dst, "destination")
    if not dst.flags.writeable:
        raise EngineError("destination array of a CUDA copy is read-only")
    if isinstance(src, DeviceBuffer) and nbytes > src.nbytes:
        raise EngineError(f"copy of {nbytes} bytes reads past a device buffer of {src.nbytes}")
    check(
        rt.cudaMemcpyAsync(
            dst.ctypes.data, _device_ptr(src), nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream.raw
        ),
        "cudaMemcpyAsync(device to host)",
    )
