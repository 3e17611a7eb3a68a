"""Throughput of an engine, and every backend this device has side by side on the same model and frames.

:func:`bench_runner` times one loaded runner (load, first inference, throughput, latency);
:func:`bench_candidates` (pure) says which backends this platform can compare and why the others
cannot: ONNX Runtime on the CPU, on CUDA and through its TensorRT provider, and native TensorRT, the
four the seed's benchmarking utilities put side by side. :func:`compare_backends` runs every usable
one on the same random input (seed 0), checks that its session really came up on the provider it
was asked for (ORT falls back to the CPU with only a warning when, say, cuDNN is missing), and
reports each one's figures and its largest output difference from the first one that ran.

``edge-agent build --bench`` prints the comparison; ``edge-agent selftest`` reuses it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from agent.backends.base import LoadOptions, ProviderRequest, Runner, get_backend
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.ort import CPU_EP, CUDA_EP, TENSORRT_EP
from agent.errors import AgentError, BuildError
from agent.machine.platform import Platform
from agent.model_contract.tensors import TensorSpec

CandidateKey = Literal["ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt"]

#: The note of the comparison row that is the engine just built (``edge-agent build``).
THIS_BUILD = "this build"

#: Warm-up runs before timing: first runs allocate, autotune and fill caches.
WARMUP_RUNS = 10


@dataclass(frozen=True)
class BenchCandidate:
    """One backend to compare: what it is, whether this device has it, and why (not)."""

    key: CandidateKey
    label: str
    usable: bool
    reason: str
    #: ONNX Runtime provider the session must run on (None for native TensorRT).
    provider: str | None = None


def bench_candidates(platform: Platform) -> list[BenchCandidate]:
    """The four backends in a fixed order, each usable or not with the reason (pure)."""
    ort = platform.backends.get("onnxruntime")
    ort_ok = ort is not None and ort.usable
    ort_why = ort.reason if ort is not None else "onnxruntime not probed"
    providers = platform.ort_providers
    listed = ", ".join(providers) or "none"

    def ort_candidate(key: CandidateKey, label: str, provider: str) -> BenchCandidate:
        if not ort_ok:
            return BenchCandidate(key, label, False, ort_why, provider)
        if provider not in providers:
            return BenchCandidate(
                key,
                label,
                False,
                f"this ONNX Runtime build has no {provider} (providers: {listed})",
                provider,
            )
        return BenchCandidate(key, label, True, f"{provider} present", provider)

    trt = platform.backends.get("tensorrt")
    native = BenchCandidate(
        "tensorrt",
        "TensorRT (native)",
        trt is not None and trt.usable,
        trt.reason if trt is not None else "tensorrt not probed",
    )
    return [
        ort_candidate("ort-cpu", "ONNX Runtime CPU", CPU_EP),
        ort_candidate("ort-cuda", "ONNX Runtime CUDA", CUDA_EP),
        ort_candidate("ort-tensorrt", "ONNX Runtime TensorRT EP", TENSORRT_EP),
        native,
    ]


def candidate_of(artifact: EngineArtifact) -> CandidateKey:
    """Which comparison row an engine the builder made is (pure): TensorRT, or its first ORT provider."""
    if artifact.backend == "tensorrt":
        return "tensorrt"
    first = artifact.providers[0] if artifact.providers else CPU_EP
    name = first if isinstance(first, str) else first[0]
    return {TENSORRT_EP: "ort-tensorrt", CUDA_EP: "ort-cuda"}.get(name, "ort-cpu")  # type: ignore[return-value]


def random_feeds(inputs: Sequence[TensorSpec], batch: int) -> dict[str, npt.NDArray[Any]]:
    """Random input (seed 0) for every input, the batch axis set to ``batch``: the same for every backend."""
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in inputs:
        dims = [batch if axis == 0 else d for axis, d in enumerate(spec.shape)]
        shape = [d for d in dims if isinstance(d, int) and d > 0]
        if len(shape) != len(dims):
            raise BuildError(f"input {spec.name!r} has dynamic axes {spec.shape}: cannot make a bench input")
        feeds[spec.name] = rng.random(shape).astype(spec.dtype)
    return feeds


def bench_runner(runner: Runner, iterations: int, batch: int, load_s: float = 0.0) -> dict[str, Any]:
    """Time ``runner`` on :func:`random_feeds`: first inference, throughput, latency mean/p50/p99."""
    feeds = random_feeds(runner.inputs, batch)
    first = time.perf_counter()
    runner.infer(feeds)
    first_s = time.perf_counter() - first
    for _ in range(min(WARMUP_RUNS, iterations)):
        runner.infer(feeds)
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        runner.infer(feeds)
        times.append(time.perf_counter() - t0)
    total = sum(times)
    ordered = sorted(times)
    return {
        "iterations": iterations,
        "batch": batch,
        "load_s": load_s,
        "first_inference_s": first_s,
        "throughput_per_s": batch * iterations / total if total > 0 else None,
        "latency_ms_mean": 1000 * statistics.fmean(times),
        "latency_ms_p50": 1000 * ordered[len(ordered) // 2],
        "latency_ms_p99": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def bench(artifact: EngineArtifact, iterations: int, batch: int) -> dict[str, Any]:
    """Load a built engine and time it (:func:`bench_runner`)."""
    started = time.perf_counter()
    runner = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
    load_s = time.perf_counter() - started
    try:
        return bench_runner(runner, iterations, batch, load_s)
    finally:
        runner.close()


@dataclass
class ComparisonRow:
    """One backend's line of a comparison: skipped (reason), failed (error) or measured."""

    key: CandidateKey
    label: str
    status: Literal["measured", "skipped", "failed"]
    reason: str
    result: dict[str, Any] | None = None
    #: Largest absolute output difference from the comparison's first measured backend.
    max_abs_diff: float | None = None
    #: "this build" when the row is the engine ``edge-agent build`` just made.
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        return {
            "key": self.key,
            "label": self.label,
            "status": self.status,
            "reason": self.reason,
            "bench": self.result,
            "max_abs_diff": self.max_abs_diff,
            "note": self.note,
        }


#: Builds the native TensorRT engine for the comparison (a cache hit when it exists already).
NativeBuild = Callable[[], EngineArtifact]


def _ort_options(candidate: BenchCandidate, work_dir: Path) -> tuple[ProviderRequest, ...]:
    if candidate.provider == TENSORRT_EP:
        # FP32 like the other ORT rows; engines go to a scratch directory, not the agent's cache.
        options = {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(work_dir)}
        return ((TENSORRT_EP, options),)
    return (candidate.provider or CPU_EP,)


def _load(
    candidate: BenchCandidate,
    model: Path,
    native: NativeBuild | None,
    built: EngineArtifact | None,
    work_dir: Path,
) -> tuple[Runner, str]:
    """The runner of one row and its note; raises AgentError when it cannot be made."""
    if built is not None and candidate_of(built) == candidate.key:
        return get_backend(built.backend).load(built.engine_path, built.load_options()), THIS_BUILD
    if candidate.key == "tensorrt":
        if native is None:
            raise BuildError("no native TensorRT build was given for the comparison")
        artifact = native()
        if artifact.backend != "tensorrt":
            raise BuildError(f"the planner built {artifact.backend}, not TensorRT: {artifact.plan.changes}")
        return get_backend("tensorrt").load(artifact.engine_path, artifact.load_options()), ""
    runner = get_backend("onnxruntime").load(model, LoadOptions(providers=_ort_options(candidate, work_dir)))
    came_up = runner.describe().get("providers") or []
    if not came_up or came_up[0] != candidate.provider:
        runner.close()
        raise BuildError(
            f"the session came up on {', '.join(came_up) or 'nothing'}, not {candidate.provider} "
            "(ONNX Runtime logged why: a missing CUDA/cuDNN/TensorRT library is the usual cause)"
        )
    return runner, ""


def compare_backends(
    model: Path,
    candidates: Sequence[BenchCandidate],
    *,
    iterations: int,
    batch: int = 1,
    native: NativeBuild | None = None,
    built: EngineArtifact | None = None,
) -> list[ComparisonRow]:
    """Run every usable candidate on the same model and frames; one row per candidate, in order.

    ``built``: an engine just made by the builder, used for its own row instead of a fresh session.
    A candidate that fails to load or run is a ``failed`` row with the reason; the others still run.
    """
    rows: list[ComparisonRow] = []
    reference: dict[str, npt.NDArray[Any]] | None = None
    with tempfile.TemporaryDirectory(prefix="edge-agent-bench-") as scratch:
        for candidate in candidates:
            if not candidate.usable:
                rows.append(ComparisonRow(candidate.key, candidate.label, "skipped", candidate.reason))
                continue
            started = time.perf_counter()
            try:
                runner, note = _load(candidate, model, native, built, Path(scratch))
            except AgentError as exc:
                rows.append(ComparisonRow(candidate.key, candidate.label, "failed", str(exc)))
                continue
            load_s = time.perf_counter() - started
            try:
                result = bench_runner(runner, iterations, batch, load_s)
                outputs = runner.infer(random_feeds(runner.inputs, batch))
            except AgentError as exc:
                rows.append(ComparisonRow(candidate.key, candidate.label, "failed", str(exc)))
                continue
            finally:
                runner.close()
            diff = None
            if reference is None:
                reference = outputs
            else:
                diff = max_abs_diff(reference, outputs)
            row = ComparisonRow(
                candidate.key, candidate.label, "measured", candidate.reason, result, diff, note
            )
            rows.append(row)
    return rows


def max_abs_diff(a: dict[str, npt.NDArray[Any]], b: dict[str, npt.NDArray[Any]]) -> float | None:
    """Largest absolute difference over the outputs both have by name (None when none is shared)."""
    shared = [name for name in a if name in b and a[name].shape == b[name].shape]
    if not shared:
        return None
    return max(
        float(np.max(np.abs(a[n].astype(np.float64) - b[n].astype(np.float64)), initial=0.0)) for n in shared
    )
