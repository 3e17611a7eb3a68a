"""Preprocessing on the GPU: one upload of the uint8 frame, one kernel straight into the engine's input.

Where a slot's engine runs on a CUDA device (TensorRT on the GPU or a DLA core), the CPU path
(:mod:`agent.camera.preprocess`) would resize, pad, reorder, normalise and lay out every full-size
frame on the CPU, then the runner would copy the finished tensor to the device. Here the decoded
BGR frame is uploaded once and a single kernel writes every element of the model input: resize
(OpenCV's ``INTER_LINEAR`` fixed-point arithmetic, from :mod:`agent.camera.linear_taps`), letterbox
padding, channel order, ``x * gain - bias`` and the layout (NCHW/NHWC) and dtype
(float32/float16/uint8). The batch tensor it fills is the engine's input buffer: the TensorRT runner
takes its device address as is (:func:`agent.backends.cuda.device_array`).

Why CuPy: it installs on a Jetson from a wheel (``cupy-cuda12x``), its ``RawKernel`` compiles CUDA C
through NVRTC at first use (no compiler on the device), and its arrays speak
``__cuda_array_interface__``, so the result goes to TensorRT without glue. CuPy is an optional
dependency (the ``gpu-preprocess`` extra); without it the slot keeps the CPU path and ``up/info``
says why (:func:`preprocess_choice`).

Tolerance against the CPU path: the resized pixel equals OpenCV's on x86 (same taps, same integer
formula; OpenCV's ARM HAL may differ by one grey level), so values differ by at most one grey level
times the gain, plus float rounding (float32: 1e-5 relative; float16: one half-precision step).

Frames in page-locked memory: an upload from pageable memory goes through the driver's staging
buffer (a host copy, then the transfer), and copying a frame into a pinned buffer first costs the
same host copy. So the decoder writes frames straight into page-locked buffers
(:class:`PinnedFrames`, handed to the stream's :class:`~agent.camera.frame_pool.FramePool`), and such a
frame is uploaded asynchronously on a copy stream while the kernel of the frame before it runs on
the compute stream; two device buffers per thread take turns, each guarded by events (the upload
waits until the kernel that read the buffer last has finished; the kernel waits for its upload).
A frame not in page-locked memory (the stream's first ones, a framed region) is uploaded as before.

``cupy`` is imported lazily, so this module imports on a machine without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.camera.linear_taps import linear_taps
from agent.camera.preprocess import Letterbox, ResizeFit, channel_gain_bias, channel_sources, resize_fit
from agent.errors import EngineError, SourceError
from agent.specs.preprocess import PreprocessSpec

#: How to get CuPy when it is missing (the reason published in ``up/info``).
INSTALL_HINT = "install the gpu-preprocess extra (CuPy for this CUDA: pip install cupy-cuda12x)"

#: Threads per block of the preprocessing kernel: 32 columns (one warp reads neighbouring pixels) x 8 rows.
BLOCK = (32, 8, 1)

_OUTPUT_TYPES = {"float32": "float", "float16": "unsigned short", "uint8": "unsigned char"}

_STORE = {
    # The multiply and subtract are rounded separately, as numpy and OpenCV do: a fused
    # multiply-add (which NVRTC would otherwise emit) rounds once and can differ in the last bit.
    "float32": "__fsub_rn(__fmul_rn((float)v, g), b)",
    "float16": "f32_to_f16(__fsub_rn(__fmul_rn((float)v, g), b))",
    "uint8": "(unsigned char)v",
}

_KERNEL = r"""
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;  // round to nearest even, as numpy and OpenCV convert (no cuda_fp16.h needed)
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

extern "C" __global__ void NAME(
    const unsigned char* __restrict__ src, const int src_stride,
    const int* __restrict__ col0, const int* __restrict__ col1,
    const int* __restrict__ colw0, const int* __restrict__ colw1,
    const int* __restrict__ row0, const int* __restrict__ row1,
    const int* __restrict__ roww0, const int* __restrict__ roww1,
    const int new_w, const int new_h, const int left, const int top,
    const int out_w, const int out_h, const int pad,
    const int c0, const int c1, const int c2,
    const float g0, const float g1, const float g2,
    const float b0, const float b1, const float b2,
    OUT_T* __restrict__ dst)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= out_w || y >= out_h) return;
    const int rx = x - left;
    const int ry = y - top;
    int bgr[3];
    if (rx < 0 || ry < 0 || rx >= new_w || ry >= new_h) {
        bgr[0] = pad; bgr[1] = pad; bgr[2] = pad;
    } else {
        const unsigned char* r0 = src + (long long)row0[ry] * src_stride;
        const unsigned char* r1 = src + (long long)row1[ry] * src_stride;
        const int xa = col0[rx] * 3, xb = col1[rx] * 3;
        const int wa = colw0[rx], wb = colw1[rx];
        const int ba = roww0[ry], bb = roww1[ry];
        for (int c = 0; c < 3; ++c) {
            // OpenCV's HResizeLinear then VResizeLinear<uchar> fixed-point steps (agent.camera.linear_taps).
            const int h0 = r0[xa + c] * wa + r0[xb + c] * wb;
            const int h1 = r1[xa + c] * wa + r1[xb + c] * wb;
            bgr[c] = (((ba * (h0 >> 4)) >> 16) + ((bb * (h1 >> 4)) >> 16) + 2) >> 2;
        }
    }
    const int from[3] = {c0, c1, c2};
    const float gain[3] = {g0, g1, g2};
    const float bias[3] = {b0, b1, b2};
    for (int k = 0; k < 3; ++k) {
        const int v = bgr[from[k]];
        const float g = gain[k];
        const float b = bias[k];
        const long long at = INDEX;
        dst[at] = STORE;
    }
}
"""

_INDEX = {
    "nchw": "((long long)k * out_h + y) * out_w + x",
    "nhwc": "((long long)y * out_w + x) * 3 + k",
}


def kernel_source(dtype: str, layout: str) -> tuple[str, str]:
    """CUDA source and entry name of the kernel writing ``dtype`` in ``layout`` (pure)."""
    if dtype not in _OUTPUT_TYPES:
        raise EngineError(f"GPU preprocessing cannot write {dtype!r}; it writes {', '.join(_OUTPUT_TYPES)}")
    if layout not in _INDEX:
        raise EngineError(f"GPU preprocessing cannot lay out {layout!r}; it writes {', '.join(_INDEX)}")
    name = f"preprocess_{dtype}_{layout}"
    code = (
        _KERNEL.replace("NAME", name)
        .replace("OUT_T", _OUTPUT_TYPES[dtype])
        .replace("INDEX", _INDEX[layout])
        .replace("STORE", _STORE[dtype])
    )
    return code, name


def launch_grid(width: int, height: int) -> tuple[int, int, int]:
    """Blocks covering a ``width x height`` input with :data:`BLOCK`-sized blocks (pure)."""
    return (-(-width // BLOCK[0]), -(-height // BLOCK[1]), 1)


def item_shape(spec: PreprocessSpec) -> tuple[int, int, int]:
    """Shape of one preprocessed item, without the batch axis (pure)."""
    if spec.layout == "nchw":
        return (3, spec.height, spec.width)
    return (spec.height, spec.width, 3)


@dataclass(frozen=True)
class PreprocessChoice:
    """Where a slot preprocesses its frames (``"gpu"`` or ``"cpu"``) and why, as ``up/info`` shows."""

    where: str
    reason: str


def preprocess_choice(
    runner: Mapping[str, Any], cupy_works: Callable[[], tuple[bool, str]]
) -> PreprocessChoice:
    """GPU preprocessing when the engine runs on a CUDA device and CuPy works; else CPU with the reason.

    ``runner`` is the runner's :meth:`~agent.backends.base.Runner.describe`; ``cupy_works`` is
    :func:`cupy_status` (passed in, and asked only for a TensorRT engine on a CUDA device, so an
    ONNX Runtime device never imports CuPy).
    """
    backend = runner.get("backend")
    device = str(runner.get("device", ""))
    if backend != "tensorrt":
        return PreprocessChoice(
            "cpu", f"the {backend} runner takes host arrays; GPU preprocessing feeds TensorRT engines only"
        )
    if device != "gpu" and not device.startswith("dla"):
        return PreprocessChoice(
            "cpu", f"the engine runs on {device or 'an unknown device'}, not a CUDA device"
        )
    ok, why = cupy_works()
    if not ok:
        return PreprocessChoice("cpu", f"GPU preprocessing unavailable: {why}")
    return PreprocessChoice("gpu", f"frames are preprocessed on the GPU into the engine's input ({why})")


def gpu_preprocessor_for(
    runner: Mapping[str, Any], spec: PreprocessSpec
) -> tuple[GpuPreprocessor | None, PreprocessChoice]:
    """A working :class:`GpuPreprocessor` for an engine when :func:`preprocess_choice` says GPU.

    The kernel is compiled and run once on a small frame here, at load: a CuPy that imports but
    cannot compile (no NVRTC, a driver too old for its CUDA) means the CPU path, with that reason,
    never a failed frame later.
    """
    choice = preprocess_choice(runner, cupy_status)
    if choice.where != "gpu":
        return None, choice
    try:
        preprocessor = GpuPreprocessor(spec)
        preprocessor.batch([np.zeros((2, 2, 3), np.uint8)])
    except Exception as exc:  # noqa: BLE001 - any CuPy/NVRTC/driver failure means the CPU path, with why
        return None, PreprocessChoice("cpu", f"GPU preprocessing failed its first frame: {exc}")
    return preprocessor, choice


def cupy_status() -> tuple[bool, str]:
    """Whether CuPy imports and sees a CUDA device, and why not (one line)."""
    try:
        import cupy
    except ImportError:
        return False, f"CuPy is not installed: {INSTALL_HINT}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CuPy's CUDARuntimeError and driver load errors alike
        return False, f"CuPy sees no CUDA device: {exc}"
    if count < 1:
        return False, "CuPy sees no CUDA device"
    return True, f"CuPy {cupy.__version__}, {count} CUDA device(s)"


class PinnedFrames:
    """Page-locked host buffers for decoded frames (CuPy's pinned memory: ``cudaHostAlloc``), and
    whether a given frame lives in one. Safe from any thread."""

    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy
        self._lock = threading.Lock()
        #: Start address -> size of every live buffer made here (an entry goes with its memory).
        self._spans: dict[int, int] = {}

    def empty(self, shape: tuple[int, ...]) -> npt.NDArray[np.uint8]:
        """A new page-locked uint8 array of ``shape`` (contents undefined)."""
        size = int(np.prod(shape))
        memory = self._cupy.cuda.alloc_pinned_memory(size)
        image: npt.NDArray[np.uint8] = np.frombuffer(memory, np.uint8, size).reshape(shape)
        address = image.ctypes.data
        with self._lock:
            self._spans[address] = size
        # On the array, not the memory: CuPy's PinnedMemoryPointer takes no weak reference. The pool
        # and the frames hold this very array; a view outliving it only goes uncounted as page-locked.
        weakref.finalize(image, self._forget, address)
        return image

    def holds(self, image: npt.NDArray[np.uint8]) -> bool:
        """True when ``image`` is one of these buffers, whole and contiguous."""
        if not image.flags.c_contiguous:
            return False
        with self._lock:
            return self._spans.get(image.ctypes.data) == image.nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)

    def _forget(self, address: int) -> None:
        with self._lock:
            self._spans.pop(address, None)


_PINNED: list[PinnedFrames] = []
_PINNED_LOCK = threading.Lock()


def pinned_frames(cupy: Any) -> PinnedFrames:
    """The process's one :class:`PinnedFrames`: every engine of a set, every slot, knows its buffers."""
    with _PINNED_LOCK:
        if not _PINNED:
            _PINNED.append(PinnedFrames(cupy))
        return _PINNED[0]


@dataclass
class _Lane:
    """One thread's device side: its streams, and two frame buffers that take turns."""

    copy: Any
    compute: Any
    buffers: list[Any] = field(default_factory=lambda: [None, None])
    #: Per buffer: recorded on the compute stream after the kernel that read it (the buffer is free).
    read: list[Any] = field(default_factory=list)
    #: Per buffer: recorded on the copy stream after its upload (the kernel may read it).
    written: list[Any] = field(default_factory=list)
    turn: int = 0


class GpuPreprocessor:
    """Preprocesses frames on the GPU for one :class:`PreprocessSpec`; safe to share between threads.

    Each calling thread gets its own CUDA streams and upload buffers (as the TensorRT runner gives
    each thread its own context). :meth:`batch` returns only when the kernels have finished, so
    the engine may read the tensor on any stream and the frames' host buffers are free again.
    Frames in :attr:`pinned` buffers are uploaded asynchronously, overlapping the kernel before.
    """

    def __init__(self, spec: PreprocessSpec, device: int = 0) -> None:
        ok, why = cupy_status()
        if not ok:
            raise EngineError(why)
        import cupy

        self.spec = spec
        self._cupy: Any = cupy
        self._device = device
        self._gain, self._bias = channel_gain_bias(spec)
        self._sources = channel_sources(spec)
        code, name = kernel_source(spec.dtype, spec.layout)
        with cupy.cuda.Device(device):
            self._kernel: Any = cupy.RawKernel(code, name)
        self._taps: dict[tuple[int, int], tuple[ResizeFit, tuple[Any, ...]]] = {}
        self._taps_lock = threading.Lock()
        self._local = threading.local()
        #: Page-locked buffers for the streams' decoders to write frames into (see the module docstring).
        self.pinned = pinned_frames(cupy)
        #: Frames uploaded from page-locked / from pageable memory (read by tests and the bench).
        self.uploads_pinned = 0
        self.uploads_pageable = 0

    def batch(self, images: Sequence[npt.NDArray[np.uint8]]) -> tuple[Any, list[Letterbox]]:
        """A ``(n, *item)`` CuPy array of ``images`` preprocessed, and each frame's :class:`Letterbox`."""
        cp = self._cupy
        spec = self.spec
        try:
            with cp.cuda.Device(self._device):
                lane = self._lane()
                with lane.compute:
                    out = cp.empty((len(images), *item_shape(spec)), dtype=np.dtype(spec.dtype))
                    boxes = [self._one(image, out[i], lane) for i, image in enumerate(images)]
                lane.compute.synchronize()
        except SourceError:
            raise
        except Exception as exc:
            raise EngineError(f"GPU preprocessing failed: {exc}") from exc
        return out, boxes

    def _one(self, image: npt.NDArray[np.uint8], dst: Any, lane: _Lane | None = None) -> Letterbox:
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise SourceError(
                f"frame is {image.dtype} with shape {image.shape}; preprocessing needs H x W x 3 uint8 BGR"
            )
        src_h, src_w = image.shape[:2]
        fit, tables = self._tables(src_w, src_h)
        lane = lane or self._lane()
        frame, turn = self._upload(image, lane)
        lane.compute.wait_event(lane.written[turn])
        with lane.compute:
            self._launch(frame, src_w=src_w, fit=fit, tables=tables, dst=dst)
        lane.read[turn].record(lane.compute)
        return fit.letterbox

    def _launch(self, frame: Any, *, src_w: int, fit: ResizeFit, tables: tuple[Any, ...], dst: Any) -> None:
        i32, f32 = np.int32, np.float32
        spec = self.spec
        self._kernel(
            launch_grid(spec.width, spec.height),
            BLOCK,
            (
                frame,
                i32(src_w * 3),
                *tables,
                i32(fit.new_w),
                i32(fit.new_h),
                i32(fit.left),
                i32(fit.top),
                i32(spec.width),
                i32(spec.height),
                i32(spec.pad_value),
                *(i32(c) for c in self._sources),
                *(f32(g) for g in self._gain),
                *(f32(b) for b in self._bias),
                dst,
            ),
        )

    def _lane(self) -> _Lane:
        lane: _Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            cuda = self._cupy.cuda
            lane = _Lane(copy=cuda.Stream(non_blocking=True), compute=cuda.Stream(non_blocking=True))
            lane.read = [cuda.Event(disable_timing=True) for _ in range(2)]
            lane.written = [cuda.Event(disable_timing=True) for _ in range(2)]
            self._local.lane = lane
        return lane

    def _upload(self, image: npt.NDArray[np.uint8], lane: _Lane) -> tuple[Any, int]:
        """The frame on the device, in this thread's next buffer, and that buffer's number."""
        turn = lane.turn
        lane.turn ^= 1
        buf = lane.buffers[turn]
        if buf is None or buf.shape != image.shape:
            # The old buffer goes back to CuPy's pool, which may hand its memory out again at once:
            # the kernel that reads it must be done first (a batch of streams of different sizes).
            lane.read[turn].synchronize()
            buf = self._cupy.empty(image.shape, dtype=np.uint8)
            lane.buffers[turn] = buf
        # Not before the kernel that read this buffer last has finished.
        lane.copy.wait_event(lane.read[turn])
        # cudaMemcpyAsync on the copy stream: from page-locked memory a DMA that returns at once;
        # from pageable memory it returns once the driver has copied the frame to its staging buffer.
        if self.pinned.holds(image):
            self.uploads_pinned += 1
        else:
            self.uploads_pageable += 1
        buf.set(np.ascontiguousarray(image), stream=lane.copy)
        lane.written[turn].record(lane.copy)
        return buf, turn

    def _tables(self, src_w: int, src_h: int) -> tuple[ResizeFit, tuple[Any, ...]]:
        """Resize geometry and taps for one frame size, uploaded once and kept (a camera keeps its size)."""
        with self._taps_lock:
            cached = self._taps.get((src_w, src_h))
            if cached is not None:
                return cached
        fit = resize_fit(src_w, src_h, self.spec)
        taps = linear_taps(src_w, src_h, fit.new_w, fit.new_h)
        arrays = (
            taps.columns.first,
            taps.columns.second,
            taps.columns.weight_first,
            taps.columns.weight_second,
            taps.rows.first,
            taps.rows.second,
            taps.rows.weight_first,
            taps.rows.weight_second,
        )
        entry = (fit, tuple(self._cupy.asarray(np.ascontiguousarray(a, dtype=np.int32)) for a in arrays))
        # Other threads use the tables on their own streams: they must be on the device first.
        self._cupy.cuda.get_current_stream().synchronize()
        with self._taps_lock:
            self._taps[(src_w, src_h)] = entry
        return entry
