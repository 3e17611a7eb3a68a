"""TensorRT backend: runs a serialized engine (plan) on the GPU or a DLA core.

TensorRT and cuda-python are imported lazily: this module imports everywhere, and
:meth:`TensorRTBackend.available` says why it cannot run when either is missing. The API used here
works from TensorRT 8.5 (JetPack 5) to 10.x (JetPack 6): tensors by name, ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3``.

An input feed may be a CUDA array (anything with ``__cuda_array_interface__``, e.g. the CuPy
tensor GPU preprocessing writes): its device address becomes the tensor's address, with no host copy.

Threading: the engine is shared, but an ``IExecutionContext`` is not thread-safe, so every thread
gets ONE context (with its own stream and buffers) on its first batch and keeps it. Creating a
context per frame leaks memory (TensorRT#582).

``LoadOptions.extra`` keys read here: ``dla_core`` (int: the DLA core the engine was built for),
``precision`` and ``placement`` (what the build reported, echoed by :meth:`TensorRTRunner.describe`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.backends import cuda
from agent.backends.base import Backend, Feeds, LoadOptions, Outputs, Runner
from agent.backends.trt_api import dims_of, nullable, succeeded, tensorrt_status
from agent.errors import EngineError
from agent.model_contract.tensors import Dim, TensorSpec

if TYPE_CHECKING:
    import tensorrt as trt

log = structlog.get_logger(__name__)


#: TensorRT ``DataType`` member name -> numpy dtype name. BF16, FP8 and FP4 have no numpy dtype.
TRT_TO_NUMPY: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
}


def numpy_dtype_name(trt_dtype_name: str) -> str:
    """numpy dtype name for a TensorRT ``DataType`` member name (``"HALF"`` -> ``"float16"``)."""
    try:
        return TRT_TO_NUMPY[trt_dtype_name.upper()]
    except KeyError:
        raise EngineError(
            f"engine tensor type {trt_dtype_name} has no numpy equivalent; "
            "rebuild the model with float32/float16/int8/int32/int64/bool/uint8 inputs and outputs"
        ) from None


def dims_to_shape(dims: Sequence[int]) -> tuple[Dim, ...]:
    """TensorRT dims (``-1`` = dynamic) as a :class:`TensorSpec` shape (``None`` = dynamic)."""
    return tuple(None if int(d) < 0 else int(d) for d in dims)


def resolve_input_shape(name: str, spec_shape: Sequence[Dim], array_shape: Sequence[int]) -> tuple[int, ...]:
    """The concrete shape to run ``name`` with, checked against the engine's shape.

    Unlike the generic check in :meth:`Runner.infer`, the batch axis is checked too: a static
    TensorRT engine cannot run any other batch size.
    """
    if len(array_shape) != len(spec_shape):
        raise EngineError(
            f"input {name!r} has {len(array_shape)} dimensions, the engine expects {len(spec_shape)}"
        )
    for axis, (got, want) in enumerate(zip(array_shape, spec_shape, strict=True)):
        if isinstance(want, int) and want >= 0 and got != want:
            raise EngineError(
                f"input {name!r} axis {axis} is {got}, the engine was built for {want}; "
                "rebuild with a shape profile to accept other sizes"
            )
    return tuple(int(d) for d in array_shape)


def required_capacity(current: int, needed: int) -> int | None:
    """New buffer size in bytes when ``needed`` does not fit ``current``, else None (reuse).

    Buffers only grow: a smaller batch reuses the larger buffer, so a stream that alternates batch
    sizes does not re-allocate on every frame.
    """
    if needed < 0:
        raise EngineError(f"negative buffer size {needed}")
    return None if needed <= current else needed


def device_label(dla_core: int | None) -> str:
    """Where the engine runs, as published: ``"dla0"``, ``"dla1"`` or ``"gpu"``."""
    return "gpu" if dla_core is None else f"dla{dla_core}"


def parse_dla_core(value: Any) -> int | None:
    """``LoadOptions.extra['dla_core']`` validated: None, or a non-negative int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineError(f"dla_core must be a non-negative integer, got {value!r}")
    return value


@dataclass
class _TensorBuffers:
    """Pinned host + device memory for one tensor; grows only (see :func:`required_capacity`)."""

    host: cuda.PinnedBuffer | None = None
    device: cuda.DeviceBuffer | None = None
    capacity: int = 0

    def ensure(self, nbytes: int) -> None:
        grow = required_capacity(self.capacity, nbytes)
        if grow is None and self.host is not None and self.device is not None:
            return
        self.free()
        size = grow if grow is not None else max(nbytes, 1)
        self.host = cuda.PinnedBuffer((size,), np.uint8)
        self.device = cuda.DeviceBuffer(size)
        self.capacity = size

    def host_view(self, shape: tuple[int, ...], dtype: str) -> npt.NDArray[Any]:
        """The first bytes of the pinned buffer as an array of ``shape``/``dtype``."""
        if self.host is None:
            raise EngineError("tensor buffer used before allocation")
        nbytes = cuda.nbytes_of(shape, dtype)
        return self.host.array[:nbytes].view(np.dtype(dtype)).reshape(shape)

    def free(self) -> None:
        if self.host is not None:
            self.host.free()
        if self.device is not None:
            self.device.free()
        self.host, self.device, self.capacity = None, None, 0


@dataclass
class _ThreadState:
    """What one thread needs to run the engine: its context, stream and buffers."""

    context: trt.IExecutionContext | None
    stream: cuda.Stream
    buffers: dict[str, _TensorBuffers] = field(default_factory=dict)

    def release(self) -> None:
        for buf in self.buffers.values():
            buf.free()
        self.buffers.clear()
        self.stream.destroy()
        self.context = None


class TensorRTRunner(Runner):
    """A deserialized TensorRT engine; one execution context per calling thread."""

    backend = "tensorrt"

    def __init__(
        self,
        runtime: trt.Runtime,
        engine: trt.ICudaEngine,
        logger: trt.ILogger,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        *,
        dla_core: int | None,
        precision: str | None = None,
        placement: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(inputs, outputs)
        # The logger must outlive every object created through the runtime.
        self._runtime: trt.Runtime | None = runtime
        self._engine: trt.ICudaEngine | None = engine
        self._logger = logger
        self._dla_core = dla_core
        self._precision = precision
        self._placement = dict(placement) if placement is not None else None
        self._local = threading.local()
        self._states: list[_ThreadState] = []
        self._states_lock = threading.Lock()

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is not None:
            return state
        if self._engine is None:
            raise EngineError("tensorrt runner is closed")
        cuda.ensure_device(0)
        context = nullable(self._engine.create_execution_context())
        if context is None:
            raise EngineError("TensorRT could not create an execution context (out of device memory?)")
        state = _ThreadState(context=context, stream=cuda.Stream())
        with self._states_lock:
            self._states.append(state)
        self._local.state = state
        return state

    def _infer(self, feeds: Feeds) -> Outputs:
        state = self._state()
        context = state.context
        if context is None:
            raise EngineError("tensorrt runner is closed")
        for spec in self.inputs:
            on_device = cuda.device_array(feeds[spec.name])
            if on_device is not None:
                # Already in device memory (GPU preprocessing): that buffer is the engine's input,
                # no host staging and no copy. The producer finished writing it before handing it in.
                if on_device.dtype != spec.dtype:
                    raise EngineError(
                        f"input {spec.name!r} is a {on_device.dtype} device array, "
                        f"the engine expects {spec.dtype}"
                    )
                _set_shape(context, spec, resolve_input_shape(spec.name, spec.shape, on_device.shape))
                context.set_tensor_address(spec.name, on_device.ptr)
                continue
            array = np.ascontiguousarray(feeds[spec.name], dtype=np.dtype(spec.dtype))
            shape = resolve_input_shape(spec.name, spec.shape, array.shape)
            _set_shape(context, spec, shape)
            buf = state.buffers.setdefault(spec.name, _TensorBuffers())
            buf.ensure(array.nbytes)
            host = buf.host_view(shape, spec.dtype)
            host[...] = array
            assert buf.device is not None
            cuda.copy_htod_async(buf.device, host, state.stream)
            context.set_tensor_address(spec.name, buf.device.ptr)
        out_shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.outputs:
            shape = tuple(dims_of(context.get_tensor_shape(spec.name)))
            if any(d < 0 for d in shape):
                raise EngineError(
                    f"output {spec.name!r} has a data-dependent shape {shape}; this runner needs shapes "
                    "known before execution"
                )
            out_shapes[spec.name] = shape
            buf = state.buffers.setdefault(spec.name, _TensorBuffers())
            buf.ensure(cuda.nbytes_of(shape, spec.dtype))
            assert buf.device is not None
            context.set_tensor_address(spec.name, buf.device.ptr)
        if not succeeded(context.execute_async_v3(state.stream.handle)):
            raise EngineError("TensorRT execute_async_v3 failed; see the TensorRT log for the reason")
        results: dict[str, npt.NDArray[Any]] = {}
        for spec in self.outputs:
            buf = state.buffers[spec.name]
            host = buf.host_view(out_shapes[spec.name], spec.dtype)
            assert buf.device is not None
            cuda.copy_dtoh_async(host, buf.device, state.stream)
            results[spec.name] = host
        state.stream.synchronize()
        # The pinned views are reused by the next batch: hand out copies.
        return {name: host.copy() for name, host in results.items()}

    def _close(self) -> None:
        # Order matters: contexts, then the engine, then the runtime. close() may run on another
        # thread than the ones that ran batches (the slot drains them first); CUDA's current
        # device is per thread, so set it before freeing.
        try:
            cuda.ensure_device(0)
        except EngineError as exc:
            log.warning("engine.tensorrt.release_failed", error=str(exc))
        with self._states_lock:
            states, self._states = self._states, []
        for state in states:
            _release_quietly(state)
        self._engine = None
        self._runtime = None

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"backend": self.backend, "device": device_label(self._dla_core)}
        if self._precision is not None:
            info["precision"] = self._precision
        if self._placement is not None:
            info["placement"] = self._placement
        return info


def _set_shape(context: trt.IExecutionContext, spec: TensorSpec, shape: tuple[int, ...]) -> None:
    if not spec.is_static and not succeeded(context.set_input_shape(spec.name, shape)):
        raise EngineError(f"input {spec.name!r} shape {shape} is outside the engine's optimisation profile")


def _release_quietly(state: _ThreadState) -> None:
    """Release one thread's state; a CUDA error while freeing is logged, never raised from close()."""
    try:
        state.release()
    except EngineError as exc:
        log.warning("engine.tensorrt.release_failed", error=str(exc))


def _tensor_specs(engine: trt.ICudaEngine, trt_module: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        spec = TensorSpec(
            name=name,
            shape=dims_to_shape(dims_of(engine.get_tensor_shape(name))),
            dtype=numpy_dtype_name(engine.get_tensor_dtype(name).name),
        )
        mode = engine.get_tensor_mode(name)
        if mode == trt_module.TensorIOMode.INPUT:
            inputs.append(spec)
        elif mode == trt_module.TensorIOMode.OUTPUT:
            outputs.append(spec)
    return inputs, outputs


class TensorRTBackend(Backend):
    """Loads serialized TensorRT engines (``engines/<key>/engine``)."""

    key = "tensorrt"

    def available(self) -> tuple[bool, str]:
        ok, why = tensorrt_status()
        if not ok:
            return False, why
        cuda_ok, cuda_why = cuda.cuda_status()
        if not cuda_ok:
            return False, f"{why} found, but CUDA is not usable: {cuda_why}"
        return True, why

    def load(self, engine: Path, options: LoadOptions) -> TensorRTRunner:
        ok, why = self.available()
        if not ok:
            raise EngineError(why)
        import tensorrt as trt

        try:
            plan = engine.read_bytes()
        except OSError as exc:
            raise EngineError(f"cannot read engine file {engine}: {exc}") from exc
        dla_core = parse_dla_core(options.extra.get("dla_core"))
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        if dla_core is not None:
            cores = runtime.num_DLA_cores
            if dla_core >= cores:
                raise EngineError(f"engine wants DLA core {dla_core} but this device has {cores} DLA core(s)")
            # Must be set BEFORE deserializing, or the engine runs on core 0 whatever it was built
            # for (ONNX Runtime had exactly this bug: onnxruntime#26680).
            runtime.DLA_core = dla_core
        cuda.ensure_device(0)
        trt_engine = nullable(runtime.deserialize_cuda_engine(plan))
        if trt_engine is None:
            raise EngineError("engine built by another TensorRT version or device: rebuild")
        inputs, outputs = _tensor_specs(trt_engine, trt)
        if not inputs or not outputs:
            raise EngineError(f"engine {engine} has no inputs or no outputs")
        runner = TensorRTRunner(
            runtime,
            trt_engine,
            logger,
            inputs,
            outputs,
            dla_core=dla_core,
            precision=options.extra.get("precision"),
            placement=options.extra.get("placement"),
        )
        log.info("engine.tensorrt.loaded", engine=str(engine), device=device_label(dla_core))
        return runner
