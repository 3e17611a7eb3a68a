"""Turn an ONNX model and a :class:`BuildSpec` into a cached engine: plan, key, cache, worker.

:class:`EngineBuilder` is what the agent (BUILDING step) and ``edge-agent build`` call:

1. hash the model (:func:`~agent.engines.cache.key.model_sha256`) and plan the build for this
   platform (:func:`~agent.engines.building.plan.plan_build`), with a reason for every change;
2. compute the cache key from the model, backend version, device, plan and calibration identity;
3. on a cache hit, return at once: time-to-active is then the engine's load time;
4. otherwise build in a child process (:class:`~agent.engines.building.worker.BuildWorker`: TensorRT where the
   plan says so, else ONNX Runtime), store the result in the cache, and return it.

The returned :class:`EngineArtifact` says what was requested and what was effectively built
(precision, device, DLA core, providers, layer placement, every change with its reason) and carries
the load options the runtime needs.

Calibration identity (part of the key): a ``cache`` source is its file's SHA-256; a ``dataset``
is the SHA-256 of its image files, the frame count and the preprocessing; a ``stream`` is its name
and frame count only, because live frames never repeat: a second deploy of the same model and spec
reuses the engine instead of recalibrating. Calibration frames are read only when a build happens.

One job (model + spec in, a cached engine out): the cache, the child process and the fallback retry
share one build lock and one artifact record. The pieces that stand alone have their own modules:
what the child gets for one build (:mod:`agent.engines.building.job_inputs`: the job, its calibration
files, the timing cache), model facts, calibration data, the artifact.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy.typing as npt
import structlog

from agent.engines.building.artifact import EngineArtifact, artifact_of, with_source
from agent.engines.building.fallback import (
    FAILED_AT,
    FailureStage,
    after_build_failure,
    fallback_refused,
    from_fleet,
    plan_fallback,
)
from agent.engines.building.history import BuildHistory, build_fingerprint
from agent.engines.building.job_inputs import default_preprocess, job_for
from agent.engines.building.ort import REPORT_FILE
from agent.engines.building.plan import PlatformFacts, plan_build
from agent.engines.building.slim import onnxslim_version
from agent.engines.building.worker import BuildWorker
from agent.engines.cache.key import EngineIdentity, engine_cache_key, model_sha256, new_engine_meta
from agent.engines.cache.store import CacheEntry, EngineCache
from agent.engines.calibration.data import calibration_identity
from agent.engines.calibration.int8 import host_cpu_flags, reduce_range_for
from agent.engines.job import MIB, Progress
from agent.engines.settings import EngineConfig
from agent.engines.sharing.cache import FleetEngineCache
from agent.errors import BuildError
from agent.machine.platform import Platform
from agent.model_contract.model_facts import model_facts
from agent.protocol.engines import DropStage
from agent.specs.build import BuildPlan, BuildSpec
from agent.specs.preprocess import PreprocessSpec

log = structlog.get_logger(__name__)

#: How much of a failed TensorRT build's error (with a crashed child's last output) job status carries.
MAX_FAILURE_CHARS = 2000


# --------------------------------------------------------------------------- the builder


class EngineBuilder:
    """Plans, builds (in a child process) and caches engines for one device. Thread-safe."""

    def _int8_weight_bits(self, plan: BuildPlan) -> dict[str, str]:
        """An ORT INT8 model's weights are 7-bit on an x86 CPU without VNNI
        (agent.engines.calibration.int8), so the key says which: the same model, plan and machine
        name can otherwise differ in CPU flags."""
        if plan.backend != "onnxruntime" or plan.precision != "int8":
            return {}
        reduced = reduce_range_for("cpu", self.platform.machine or "", host_cpu_flags())
        return {"int8_weight_bits": "7" if reduced else "8"}

    def __init__(
        self,
        state_dir: Path,
        config: EngineConfig,
        platform: Platform,
        *,
        worker: BuildWorker | None = None,
    ) -> None:
        # Absolute: the build child gets these paths and must not depend on the working directory.
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.platform = platform
        self.facts = PlatformFacts.from_platform(platform)
        self.cache = EngineCache(self.state_dir / "engines", config.cache_max_mb * MIB)
        self.history = BuildHistory(self.state_dir / "engines")
        self.jobs_dir = self.state_dir / "build"
        self.worker = worker or BuildWorker(
            timeout_s=config.build_timeout_s,
            memory_mb=config.build_memory_mb,
            lock_path=self.state_dir / "build.lock",
        )
        self._build_lock = threading.Lock()
        #: The cache's second level at the controller (None: none; set by the composition root).
        self.fleet: FleetEngineCache | None = None
        self._remove_stale_jobs()

    def protect(self, keys: Iterable[str]) -> None:
        """Keys eviction must never remove: the active and last-known-good engines of every slot."""
        self.cache.protect(keys)

    def plan(self, model: Path, spec: BuildSpec | None) -> BuildPlan:
        """The plan :meth:`build` would follow (no build, no cache lookup)."""
        static, has_qdq = model_facts(model)
        return plan_build(_spec_or_default(spec), self.facts, model_static=static, model_has_qdq=has_qdq)

    def build(
        self,
        model: Path,
        spec: BuildSpec | None,
        *,
        calibration: Iterable[npt.NDArray[Any]] | None = None,
        preprocess: PreprocessSpec | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> EngineArtifact:
        """The engine for ``model`` built as ``spec`` says, from the cache when it is there.

        ``spec`` None: FP32 ONNX Runtime on CPU (the optimized model). ``calibration``: preprocessed
        batches for INT8 (``[N, ...]`` arrays), consumed only when a build happens; without them a
        ``dataset`` source is read from its directory with ``preprocess`` (default: the model's
        input size, RGB, pixels / 255). Raises :class:`BuildError` naming what went wrong.
        """
        model = Path(model)
        say = _safe_progress(progress)
        started = time.monotonic()
        requested = _spec_or_default(spec)
        static, has_qdq = model_facts(model)
        plan = plan_build(requested, self.facts, model_static=static, model_has_qdq=has_qdq)
        if plan.backend == "tensorrt" and calibration is not None:
            # A failed TensorRT build falls back to ONNX Runtime, which needs the same frames again.
            calibration = list(calibration)
        try:
            return self._build_plan(
                model,
                plan,
                requested,
                calibration=calibration,
                preprocess=preprocess,
                say=say,
                cancel=cancel,
                started=started,
            )
        except BuildError as exc:
            step = after_build_failure(
                plan.backend,
                str(exc),
                busy=isinstance(exc, _BuilderBusyError),
                cancelled=cancel is not None and cancel.is_set(),
            )
            if step.action != "onnxruntime":
                raise
            return self._fall_back(
                model,
                requested,
                step.failure or str(exc),
                stage="build",
                calibration=calibration,
                preprocess=preprocess,
                say=say,
                cancel=cancel,
                started=started,
                cause=exc,
            )

    def build_fallback(
        self,
        model: Path,
        spec: BuildSpec,
        failure: str,
        *,
        calibration: Iterable[npt.NDArray[Any]] | None = None,
        preprocess: PreprocessSpec | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> EngineArtifact:
        """The ONNX Runtime engine for ``model`` after its TensorRT engine, built as ``spec`` asked,
        failed to load or validate with ``failure`` (the slot's load error).

        Plans with :func:`~agent.engines.building.fallback.plan_fallback` (stage ``load``) and builds like
        :meth:`build`; ``effective.fallback`` names the failure. Raises :class:`BuildError` when the
        spec says ``fallback: none`` or the ONNX Runtime build fails too.
        """
        return self._fall_back(
            Path(model),
            spec,
            failure,
            stage="load",
            calibration=calibration,
            preprocess=preprocess,
            say=_safe_progress(progress),
            cancel=cancel,
            started=time.monotonic(),
            cause=None,
        )

    def _fall_back(
        self,
        model: Path,
        requested: BuildSpec,
        failure: str,
        *,
        stage: FailureStage,
        calibration: Iterable[npt.NDArray[Any]] | None,
        preprocess: PreprocessSpec | None,
        say: Progress,
        cancel: threading.Event | None,
        started: float,
        cause: BuildError | None,
    ) -> EngineArtifact:
        """Build the ONNX Runtime fallback after TensorRT failed at ``stage``; the record says why."""
        what = FAILED_AT[stage]
        # The first line names the failure; a crash adds the child's last output after it.
        headline = failure.splitlines()[0] if failure else "no reason given"
        static, has_qdq = model_facts(model)
        fallback = plan_fallback(
            requested, self.facts, headline, model_static=static, model_has_qdq=has_qdq, stage=stage
        )
        if fallback is None:
            raise BuildError(fallback_refused(stage, failure)) from cause
        log.warning(f"engine.{stage}.tensorrt_failed", model=model.name, error=failure)
        say(f"{what.removeprefix('the ')}: {failure}; falling back to ONNX Runtime")
        try:
            artifact = self._build_plan(
                model,
                fallback,
                requested,
                calibration=calibration,
                preprocess=preprocess,
                say=say,
                cancel=cancel,
                started=started,
            )
        except BuildError as second:
            raise BuildError(f"{what}: {failure}; the ONNX Runtime fallback failed too: {second}") from second
        record = {
            "from": "tensorrt",
            "to": "onnxruntime",
            "stage": stage,
            "reason": headline,
            "error": failure[:MAX_FAILURE_CHARS],
        }
        return replace(artifact, effective={**artifact.effective, "fallback": record})

    def _build_plan(
        self,
        model: Path,
        plan: BuildPlan,
        requested: BuildSpec,
        *,
        calibration: Iterable[npt.NDArray[Any]] | None,
        preprocess: PreprocessSpec | None,
        say: Progress,
        cancel: threading.Event | None,
        started: float,
    ) -> EngineArtifact:
        """Key, cache lookup and (on a miss) the build of one plan."""
        for change in plan.changes:
            say(f"plan: {change.field} {change.requested} -> {change.effective}: {change.reason}")
        if (
            plan.precision == "int8"
            and plan.calibration is not None
            and preprocess is None
            and calibration is None
        ):
            preprocess = default_preprocess(model) if plan.calibration.kind == "dataset" else None
        calib_sha = (
            calibration_identity(plan.calibration, preprocess) if plan.calibration is not None else None
        )
        identity = EngineIdentity.for_build(
            model_sha256=model_sha256(model),
            plan=plan,
            platform=self.platform,
            calibration_sha256=calib_sha,
            extra={**self._int8_weight_bits(plan), **_slim_identity(plan)},
        )
        key = engine_cache_key(identity)
        entry = self.cache.get(key)
        if entry is not None:
            say(f"cache hit {key[:12]}")
            log.info("engine.cache.hit", key=key, model=model.name)
            artifact = self._artifact(
                entry, plan, requested, cache_hit=True, seconds=time.monotonic() - started
            )
            return with_source(artifact, "cache", entry)
        fetched = self.fleet.fetch(self.cache, key, identity, say, cancel) if self.fleet is not None else None
        if fetched is not None:  # level two: the fleet's engine, downloaded and verified
            artifact = self._artifact(fetched.entry, plan, requested, cache_hit=True, seconds=fetched.seconds)
            return with_source(artifact, "downloaded", fetched.entry, seconds=fetched.seconds)
        # Said before waiting for the build lock: a slot that must build serves its interim model now.
        estimate, builds = self.history.estimate(build_fingerprint(identity))
        # The estimate rides on the line (progress is text): agent.engines.building.progress reads it back.
        known = f" (estimate {estimate:.0f}s from {builds} earlier builds)" if estimate is not None else ""
        say(f"cache miss {key[:12]}: building with {plan.backend}{known}")
        # One build at a time per builder; the worker also serialises builds across processes.
        wait_s = self.config.build_timeout_s + 60.0
        if not self._build_lock.acquire(timeout=wait_s):
            self.release_claim(key, "the builder was busy")
            raise _BuilderBusyError(f"another build is still running after {wait_s:.0f}s; retry later")
        try:
            return self._build_locked(
                model=model,
                plan=plan,
                requested=requested,
                identity=identity,
                key=key,
                calibration=calibration,
                preprocess=preprocess,
                say=say,
                cancel=cancel,
                started=started,
            )
        except BaseException as exc:
            self.release_claim(key, f"the build failed: {exc}")  # the fleet's next asker builds it
            raise
        finally:
            self._build_lock.release()

    def dropped_from_fleet(
        self, artifact: EngineArtifact, error: Exception, *, stage: DropStage = "load"
    ) -> bool:
        """``artifact`` came from the fleet and failed here with ``error``: dropped (and reported);
        False when it was this device's own engine (nothing done: the caller's failure stands)."""
        if self.fleet is None or not from_fleet(artifact.effective):
            return False
        return self.fleet.dropped(self.cache, artifact.key, str(error), stage)

    def release_claim(self, key: str, reason: str) -> None:
        """This device will offer no engine for ``key``: a build claim it holds ends (no-op without
        a fleet, or without a claim)."""
        if self.fleet is not None:
            self.fleet.release(key, reason)

    def _build_locked(
        self,
        *,
        model: Path,
        plan: BuildPlan,
        requested: BuildSpec,
        identity: EngineIdentity,
        key: str,
        calibration: Iterable[npt.NDArray[Any]] | None,
        preprocess: PreprocessSpec | None,
        say: Progress,
        cancel: threading.Event | None,
        started: float,
    ) -> EngineArtifact:
        # A concurrent build of the same engine may have finished while this one waited.
        entry = self.cache.get(key)
        if entry is not None:
            say(f"cache hit {key[:12]} (built meanwhile)")
            return self._artifact(entry, plan, requested, cache_hit=True, seconds=time.monotonic() - started)
        fingerprint = build_fingerprint(identity)
        log.info("engine.cache.miss", key=key, model=model.name, backend=plan.backend)
        job_dir = self.jobs_dir / f"{key[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            job = job_for(
                model,
                plan,
                job_dir,
                calibration,
                preprocess,
                state_dir=self.state_dir,
                platform=self.platform,
            )
            result = self.worker.run(job, say, cancel)
            engine_path = job.out_dir / result.engine_file
            if not engine_path.is_file():
                raise BuildError(f"the builder reported success but wrote no engine file {engine_path.name}")
            report_path = job.out_dir / REPORT_FILE
            report_path.write_text(json.dumps(result.report, default=str, indent=2), encoding="utf-8")
            meta = new_engine_meta(
                identity,
                engine_path=engine_path,
                build_seconds=result.build_seconds,
                plan=plan,
                extra=result.extra,
            )
            files = {name: job.out_dir / name for name in (*result.files, REPORT_FILE)}
            entry = self.cache.put(key, engine_path, meta, files=files, move=True)
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
        self.history.record(fingerprint, result.build_seconds)
        say(f"built in {result.build_seconds:.1f}s, cached as {key[:12]}")
        artifact = self._artifact(entry, plan, requested, cache_hit=False, seconds=time.monotonic() - started)
        return with_source(artifact, "built", entry, seconds=result.build_seconds)

    # -- helpers -----------------------------------------------------------------------------

    def _artifact(
        self, entry: CacheEntry, plan: BuildPlan, requested: BuildSpec, *, cache_hit: bool, seconds: float
    ) -> EngineArtifact:
        timing_dir = self.state_dir / "timing"
        return artifact_of(
            entry, plan, requested, self.platform, timing_dir=timing_dir, cache_hit=cache_hit, seconds=seconds
        )

    def _remove_stale_jobs(self) -> None:
        """Job directories left by a crashed agent (older than any build may run)."""
        if not self.jobs_dir.is_dir():
            return
        horizon = time.time() - (self.config.build_timeout_s + 600.0)
        for child in self.jobs_dir.iterdir():
            with contextlib.suppress(OSError):
                if child.stat().st_mtime < horizon:
                    shutil.rmtree(child, ignore_errors=True)


def _slim_identity(plan: BuildPlan) -> dict[str, str]:
    # Another onnxslim version may slim differently: its version is part of the engine's identity.
    return {"onnxslim": onnxslim_version() or "absent"} if plan.slim else {}


class _BuilderBusyError(BuildError):
    """The builder stayed busy with another build: nothing was tried, so nothing to fall back from."""


def _spec_or_default(spec: BuildSpec | None) -> BuildSpec:
    # No build spec: run the model as given, FP32 on the CPU (ONNX Runtime's optimized copy).
    return spec if spec is not None else BuildSpec(precision="fp32", device="cpu")


def _safe_progress(progress: Progress | None) -> Progress:
    def say(message: str) -> None:
        if progress is None:
            return
        try:
            progress(message)
        except Exception as exc:  # noqa: BLE001 - an observer must not fail the build
            log.warning("engine.build.progress_callback_failed", error=str(exc))

    return say


__all__ = ["EngineArtifact", "EngineBuilder"]
