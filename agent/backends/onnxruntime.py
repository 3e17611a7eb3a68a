"""ONNX Runtime backend: runs an ONNX model (or ORT's optimized copy of it) on the providers present.

``onnxruntime`` is imported here only, guarded, so the agent imports without it and this backend
reports itself unavailable with the import error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from agent.backends.base import SMALL_MODEL_MS, Backend, Feeds, LoadOptions, Outputs, Runner
from agent.errors import EngineError
from agent.machine.cpus import usable_cpus
from agent.model_contract.tensors import TensorSpec

try:
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency; guarded for slim images
    ort = None
    _IMPORT_ERROR = f"onnxruntime is not importable: {exc}"
else:
    _IMPORT_ERROR = ""

log = structlog.get_logger(__name__)

CPU = "CPUExecutionProvider"

#: ORT element type strings to numpy dtype names (TensorSpec.dtype).
_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
    "tensor(string)": "object",
}

ProviderRequest = str | tuple[str, dict[str, Any]]


def numpy_dtype(ort_type: str) -> str:
    """``tensor(float)`` -> ``float32``; unknown types keep ORT's inner name (``tensor(x)`` -> ``x``)."""
    if ort_type in _DTYPES:
        return _DTYPES[ort_type]
    return ort_type.removeprefix("tensor(").removesuffix(")")


def _tensor_specs(args: Sequence[Any]) -> list[TensorSpec]:
    return [TensorSpec(name=a.name, shape=tuple(a.shape), dtype=numpy_dtype(a.type)) for a in args]


def _require_ort() -> Any:
    if ort is None:
        raise EngineError(f"{_IMPORT_ERROR}; install onnxruntime or choose another backend")
    return ort


def select_providers(
    requested: Sequence[ProviderRequest], available: Sequence[str]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Requested providers that this ORT build has, in order, with their options; CPU always last resort.

    Each skipped provider is logged as ``engine.provider.missing``.
    """
    names: list[str] = []
    options: list[dict[str, Any]] = []
    for request in requested:
        name, opts = (request, {}) if isinstance(request, str) else (request[0], dict(request[1]))
        if name not in available:
            log.warning("engine.provider.missing", provider=name, available=list(available))
            continue
        if name not in names:
            names.append(name)
            options.append(opts)
    if CPU not in names:
        names.append(CPU)
        options.append({})
    return names, options


#: What an interim model (served while its engine builds) may run on, best first. Not the TensorRT
#: provider: it builds an engine of its own before its first frame, the very wait interim serving avoids.
INTERIM_PREFERENCE = ("CUDAExecutionProvider", CPU)


def interim_providers(available: Sequence[str] | None = None) -> tuple[str, ...]:
    """The best providers present for an interim model (CPU always last); ``available``: ORT's list."""
    if available is None:
        available = ort.get_available_providers() if ort is not None else [CPU]
    present = tuple(p for p in INTERIM_PREFERENCE if p in available)
    return present if CPU in present else (*present, CPU)


#: ``LoadOptions.extra`` key: let ORT's intra-op worker threads busy-wait between operators (bool).
ALLOW_SPINNING = "allow_spinning"


def _session_options(intra_op_threads: int, allow_spinning: bool = False) -> Any:
    rt = _require_ort()
    so = rt.SessionOptions()
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads > 0:
        so.intra_op_num_threads = intra_op_threads
    if not allow_spinning:
        # ORT's pool threads spin after every operator waiting for more work (its default). Between
        # camera frames there is none, and with small models the spinning threads burn most of a
        # core. The agent overlaps decode/preprocess with inference in other
        # threads, which need that core; a parked pool thread costs only a futex wake per run.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def _create_session(path: Path, so: Any, providers: Sequence[ProviderRequest]) -> Any:
    rt = _require_ort()
    if not path.is_file():
        raise EngineError(f"engine file {path} does not exist; rebuild or redeploy the model")
    names, options = select_providers(providers, rt.get_available_providers())
    try:
        return rt.InferenceSession(str(path), sess_options=so, providers=names, provider_options=options)
    except Exception as exc:
        # ORT raises its own pybind exception types (InvalidProtobuf, Fail, NotImplemented, ...).
        raise EngineError(f"ONNX Runtime cannot load {path}: {exc}".strip()) from exc


def probe_ms(session: Any, runs: int = 5) -> float | None:
    """Fastest ms of a batch-1 inference on zeros (stops once two runs show the model is not small);
    None when an input shape is not fixed.

    The fastest run, not the median: on a busy machine most runs also wait for a core or for the GIL,
    and a small model measured by its median would be loaded as a large one.
    """
    feeds: dict[str, Any] = {}
    for spec in _tensor_specs(session.get_inputs()):
        dims = [1 if i == 0 and not isinstance(d, int) else d for i, d in enumerate(spec.shape)]
        if not all(isinstance(d, int) and d > 0 for d in dims) or spec.dtype == "bfloat16":
            return None
        feeds[spec.name] = np.zeros(dims, dtype=spec.dtype)
    try:
        session.run(None, feeds)  # warm-up: first runs allocate
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append((time.perf_counter() - start) * 1000.0)
            if len(times) >= 2 and min(times) > 2 * SMALL_MODEL_MS:
                break  # clearly not small: spare a heavy model's load the other runs
    except Exception:  # noqa: BLE001 - a model that cannot run on zeros is judged by validation, not here
        return None
    return min(times)


def split_threads(requested: int, cpus: int, parallel_runs: int) -> int:
    """Intra-op threads to create a session with (pure); 0 leaves the count to ONNX Runtime.

    An explicit request wins. With several runs side by side each gets its share of the cores (at
    least one), so the workers do not oversubscribe the CPU and wait on each other's threads.
    """
    if requested > 0:
        return requested
    if parallel_runs > 1:
        return max(1, cpus // parallel_runs)
    return 0


def small_model_threads(requested: int, probe: float | None, cpus: int) -> int | None:
    """The thread count to reload a session with, or None to keep it (pure)."""
    if requested != 0 or probe is None or cpus < 2 or probe >= SMALL_MODEL_MS:
        return None
    return 1


def _spinning(session: Any) -> bool:
    """Whether the session's intra-op threads busy-wait (ORT's default when the entry is absent)."""
    try:
        value = session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:  # noqa: BLE001 - ORT raises a plain RuntimeError for an entry never set
        return True
    return str(value) != "0"


class OnnxRuntimeRunner(Runner):
    """One InferenceSession; outputs come back as a dict by output name."""

    backend = "onnxruntime"

    def __init__(self, session: Any, path: Path, threads: str = "default") -> None:
        super().__init__(_tensor_specs(session.get_inputs()), _tensor_specs(session.get_outputs()))
        self._session = session
        self._path = path
        self._threads = threads
        self._spinning = _spinning(session)
        self._output_names = [o.name for o in self.outputs]

    def _infer(self, feeds: Feeds) -> Outputs:
        try:
            results = self._session.run(None, dict(feeds))
        except Exception as exc:
            raise EngineError(f"ONNX Runtime inference failed on {self._path.name}: {exc}") from exc
        return dict(zip(self._output_names, results, strict=True))

    def _close(self) -> None:
        self._session = None

    def on_caller(self) -> Runner | None:
        if self.runs_on_caller or self._session is None:
            return super().on_caller()
        if list(self._session.get_providers()) != [CPU]:
            return None  # the run's work is on a device: the thread's CPU time says nothing of it
        # The same file, one intra-op thread: ONNX Runtime makes no pool and runs on the caller.
        session = _create_session(self._path, _session_options(1), [CPU])
        runner = OnnxRuntimeRunner(session, self._path, "1 (on the caller, for timing)")
        runner.runs_on_caller = True
        return runner

    def describe(self) -> dict[str, Any]:
        providers = list(self._session.get_providers()) if self._session is not None else []
        return {
            "backend": self.backend,
            "providers": providers,
            "model": str(self._path),
            "version": ort.__version__ if ort is not None else None,
            "allow_spinning": self._spinning,
            "intra_op_threads": self._threads,
        }


class OnnxRuntimeBackend(Backend):
    """Loads ONNX models into ONNX Runtime sessions (CPU everywhere; CUDA/TensorRT EPs when built in)."""

    key = "onnxruntime"

    def available(self) -> tuple[bool, str]:
        if ort is None:
            return False, _IMPORT_ERROR
        return True, f"onnxruntime {ort.__version__}, providers {', '.join(ort.get_available_providers())}"

    def load(self, engine: Path, options: LoadOptions) -> OnnxRuntimeRunner:
        engine = Path(engine)
        spinning = bool(options.extra.get(ALLOW_SPINNING, False))
        cpus = usable_cpus()
        initial = split_threads(options.intra_op_threads, cpus, options.parallel_runs)
        session = _create_session(engine, _session_options(initial, spinning), options.providers)
        threads = str(initial) if initial else "default"
        if initial != options.intra_op_threads:
            threads = f"{initial} (auto: {options.parallel_runs} runs side by side on {cpus} cores)"
        took: float | None = None
        count = initial
        if options.intra_op_threads == 0 and list(session.get_providers()) == [CPU]:
            took = probe_ms(session)
            auto = small_model_threads(initial, took, cpus)
            if auto is not None:
                # Only the providers that came up the first time: their warnings were logged then.
                session = _create_session(engine, _session_options(auto, spinning), session.get_providers())
                threads = f"{auto} (auto: {took:.2f} ms per frame)"
                count = auto
        runner = OnnxRuntimeRunner(session, engine, threads)
        runner.probe_ms = took
        # One intra-op thread on the CPU provider: ONNX Runtime makes no pool and runs on the caller.
        runner.runs_on_caller = count == 1 and list(session.get_providers()) == [CPU]
        log.info("engine.loaded", backend=self.key, model=str(engine), providers=session.get_providers())
        return runner


def optimize_model(src: Path, dst: Path, providers: Sequence[ProviderRequest] = (CPU,)) -> Path:
    """Write ORT's fully optimized version of ``src`` to ``dst`` (atomically) and return ``dst``.

    The result is specific to the providers and machine it was made for, which is why the engine
    cache keys it by backend version and device.
    """
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    so = _session_options(0)
    so.optimized_model_filepath = str(tmp)
    try:
        _create_session(src, so, providers)
        if not tmp.is_file():
            raise EngineError(f"ONNX Runtime wrote no optimized model for {src}")
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst
