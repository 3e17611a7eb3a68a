"""The agent's side of engine builds: a slot's model and build request in, a loadable engine out.

Wraps :class:`agent.engines.builder.EngineBuilder` (plan, cache, worker) with what only the running
agent has: live frames of the slot's streams, for calibration (``calibration.kind: stream``) and
for the INT8 accuracy guard. An INT8 engine whose top-1 agreement with FP32 on held-out frames is
below ``engines.int8_agreement`` never goes live: the build falls back to FP16 and says why.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.backends.base import LoadOptions, get_backend
from agent.camera.preprocess_spec import PreprocessSpec
from agent.engines.artifact import EngineArtifact
from agent.engines.builder import EngineBuilder
from agent.engines.calibration_store import CalibrationKey, CalibrationStore, collect_frames
from agent.engines.guard import agreement, check_int8
from agent.engines.int8 import quantize_int8
from agent.engines.model_facts import model_facts
from agent.engines.placement_choice import CandidateTiming, choose_placement
from agent.engines.plan import engine_devices, placement_candidates
from agent.engines.settings import EngineConfig
from agent.engines.spec import BuildSpec
from agent.engines.timing import time_runner
from agent.errors import BuildError, EngineError

log = structlog.get_logger(__name__)

#: ``frames(slot, n)``: copies of the next ``n`` frames a slot's streams capture ([] if it has none).
FrameSource = Callable[[str, int], list[npt.NDArray[np.uint8]]]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class PreparedEngine:
    """An engine to load into a slot, and the requested-vs-effective report for job status."""

    artifact: EngineArtifact
    effective: dict[str, Any] = field(default_factory=dict)


class EngineService:
    """Builds engines for slots; one build at a time (the worker enforces it across processes too)."""

    def __init__(self, builder: EngineBuilder, config: EngineConfig, frames: FrameSource) -> None:
        self.builder = builder
        self.config = config
        self.frames = frames
        self.calibrations = CalibrationStore(builder.state_dir)
        self._lock = threading.Lock()

    def prepare(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec | None,
        preprocess: PreprocessSpec,
        *,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> PreparedEngine:
        """Build (or find) the engine for ``model``; INT8 only if it passes the accuracy guard."""
        say = progress or (lambda _msg: None)
        calibration = self._stream_calibration(slot, spec, preprocess, say)
        artifact, placement = self._placed_build(
            slot, model, spec, calibration=calibration, preprocess=preprocess, say=say, cancel=cancel
        )
        effective = dict(artifact.effective)
        if placement is not None:
            effective["requested"] = {**effective.get("requested", {}), "device": "auto"}
            effective["placement_choice"] = placement
        return self._int8_guarded(
            slot, model, spec, artifact, effective, preprocess=preprocess, say=say, cancel=cancel
        )

    def prepare_fallback(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec,
        preprocess: PreprocessSpec,
        failure: str,
        *,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> PreparedEngine:
        """The ONNX Runtime engine for ``model`` after the TensorRT engine built for ``spec`` failed to
        load or validate with ``failure`` (:meth:`EngineBuilder.build_fallback`), through the same
        INT8 guard as :meth:`prepare`. One engine, even when ``spec.devices`` asked for a set: ONNX
        Runtime serves the slot alone until the next deploy. Raises BuildError (``fallback: none``)."""
        say = progress or (lambda _msg: None)
        single = spec.model_copy(update={"devices": None}) if spec.devices is not None else spec
        calibration = self._stream_calibration(slot, single, preprocess, say)
        artifact = self.builder.build_fallback(
            model,
            single,
            failure,
            calibration=calibration,
            preprocess=preprocess,
            progress=say,
            cancel=cancel,
        )
        return self._int8_guarded(
            slot,
            model,
            single,
            artifact,
            dict(artifact.effective),
            preprocess=preprocess,
            say=say,
            cancel=cancel,
        )

    def _int8_guarded(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec | None,
        artifact: EngineArtifact,
        effective: dict[str, Any],
        *,
        preprocess: PreprocessSpec,
        say: Progress,
        cancel: threading.Event | None,
    ) -> PreparedEngine:
        """``artifact``, or its FP16 rebuild when it is INT8 and fails the accuracy guard."""
        if artifact.plan.precision != "int8":
            return PreparedEngine(artifact, effective)
        ok, reason, report = self._guard(slot, model, artifact, preprocess)
        effective["int8_guard"] = {"passed": ok, "reason": reason, **(report or {})}
        say(f"int8 guard: {reason}")
        if ok:
            return PreparedEngine(artifact, effective)
        log.warning("engine.int8.rejected", slot=slot, reason=reason)
        fallback = (spec or BuildSpec()).model_copy(update={"precision": "fp16", "calibration": None})
        load_failure = (artifact.effective.get("fallback") or {}).get("stage") == "load"
        if load_failure:
            # A plain build would plan TensorRT again, whose engine this device already failed to load.
            failure = str(artifact.effective["fallback"]["error"])
            artifact = self.builder.build_fallback(
                model, fallback, failure, preprocess=preprocess, progress=say, cancel=cancel
            )
        else:
            artifact = self.builder.build(model, fallback, preprocess=preprocess, progress=say, cancel=cancel)
        effective = {**artifact.effective, "int8_guard": effective["int8_guard"], "fallback_reason": reason}
        return PreparedEngine(artifact, effective)

    def prepare_set(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec | None,
        preprocess: PreprocessSpec,
        *,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> list[PreparedEngine]:
        """The engines of a slot: one per device of ``spec.devices`` (each its own build and cache
        entry, as if ``device`` named it), or the one :meth:`prepare` gives when ``devices`` is unset.

        Each engine's effective report carries ``engine_device`` (what the set asked for) and
        ``engine_reason`` (why that device is in the set). One failed engine fails the set: a slot
        never serves part of what the operator asked for without saying so.
        """
        if spec is None or spec.devices is None:
            return [self.prepare(slot, model, spec, preprocess, progress=progress, cancel=cancel)]
        say = progress or (lambda _msg: None)
        static, _ = model_facts(model)
        devices = engine_devices(spec, self.builder.facts, model_static=static)
        say(f"engines: {len(devices)} ({', '.join(d for d, _ in devices)})")
        prepared: list[PreparedEngine] = []
        for device, reason in devices:
            one = self.prepare(slot, model, spec.for_device(device), preprocess, progress=say, cancel=cancel)
            prepared.append(
                PreparedEngine(
                    one.artifact, {**one.effective, "engine_device": device, "engine_reason": reason}
                )
            )
        return prepared

    def _placed_build(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec | None,
        *,
        calibration: list[npt.NDArray[Any]] | None,
        preprocess: PreprocessSpec,
        say: Progress,
        cancel: threading.Event | None,
    ) -> tuple[EngineArtifact, dict[str, Any] | None]:
        """``device: auto`` with several candidate devices: build each, time each on the slot's live
        frames, keep the one :func:`choose_placement` picks (report for job status). Otherwise, or
        when nothing could be timed, the planner's choice."""

        def planned() -> EngineArtifact:
            return self.builder.build(
                model, spec, calibration=calibration, preprocess=preprocess, progress=say, cancel=cancel
            )

        if spec is None or spec.device != "auto":
            return planned(), None
        static, _ = model_facts(model)
        candidates = placement_candidates(spec, self.builder.facts, model_static=static)
        if len(candidates) < 2:
            return planned(), None
        report: dict[str, Any] = {"candidates": list(candidates), "prefer": spec.prefer}
        images = self.frames(slot, self.config.placement_frames)
        if not images:
            report["reason"] = "the slot's streams delivered no frames to time on: the planner's choice"
            say(f"placement: {report['reason']}")
            return planned(), report
        tensors = collect_frames(images, len(images), preprocess, batch_size=1)
        specs = {d: spec.model_copy(update={"device": d, "fallback": "none"}) for d in candidates}
        built, timed, failed = self.measure_candidates(
            model, specs, tensors, calibration=calibration, preprocess=preprocess, say=say, cancel=cancel
        )
        report["timings"] = [t.as_dict() for t in timed]
        report["failed"] = failed
        if not timed:
            report["reason"] = "no candidate could be built and timed: the planner's choice"
            say(f"placement: {report['reason']}")
            return planned(), report
        choice = choose_placement(timed, spec.prefer, dla_max_slowdown=self.config.placement_dla_max_slowdown)
        report.update(chosen=list(choice.devices), reason=choice.reason)
        say(f"placement: {choice.reason}")
        log.info("engine.placement.chosen", slot=slot, chosen=choice.devices, reason=choice.reason)
        return built[choice.devices[0]], report

    def measure_candidates(
        self,
        model: Path,
        specs: dict[str, BuildSpec],
        frames: list[npt.NDArray[Any]],
        *,
        calibration: list[npt.NDArray[Any]] | None = None,
        preprocess: PreprocessSpec | None = None,
        say: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[dict[str, EngineArtifact], list[CandidateTiming], dict[str, str]]:
        """Build each candidate of ``specs`` (label -> spec) and time it on ``frames`` for
        ``engines.placement_seconds``: the artifacts, the timings, and why a candidate failed."""
        tell = say or (lambda _msg: None)
        built: dict[str, EngineArtifact] = {}
        timed: list[CandidateTiming] = []
        failed: dict[str, str] = {}
        for label, candidate in specs.items():
            try:
                artifact = self.builder.build(
                    model,
                    candidate,
                    calibration=calibration,
                    preprocess=preprocess,
                    progress=say,
                    cancel=cancel,
                )
                runner = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
                try:
                    timing = time_runner(runner, frames, seconds=self.config.placement_seconds, cancel=cancel)
                finally:
                    runner.close()
            except (BuildError, EngineError) as exc:
                if cancel is not None and cancel.is_set():
                    raise
                failed[label] = (str(exc).splitlines() or ["no reason given"])[0]
                tell(f"placement: candidate {label} dropped: {failed[label]}")
                continue
            placement = artifact.effective.get("placement") or {}
            built[label] = artifact
            timed.append(
                CandidateTiming(
                    device=label,
                    fps=timing.fps,
                    p50_ms=timing.p50_ms,
                    frames=timing.frames,
                    dla_layers=placement.get("dla_layers"),
                    gpu_layers=placement.get("gpu_layers"),
                )
            )
            tell(f"placement: {label} {timing.fps:.1f} fps, p50 {timing.p50_ms:.2f} ms")
        return built, timed, failed

    def _stream_calibration(
        self, slot: str, spec: BuildSpec | None, preprocess: PreprocessSpec, say: Progress
    ) -> list[npt.NDArray[Any]] | None:
        if spec is None or spec.calibration is None or spec.calibration.kind != "stream":
            return None
        wanted = spec.calibration.frames
        say(f"calibration: collecting {wanted} frames of slot {slot}")
        images = self.frames(slot, wanted)
        if not images:
            raise BuildError(
                f"INT8 calibration needs {wanted} frames of slot {slot!r} but its streams delivered none: "
                "check the cameras, or calibrate from a cache file or dataset"
            )
        return collect_frames(images, len(images), preprocess)

    def _guard(
        self, slot: str, model: Path, artifact: EngineArtifact, preprocess: PreprocessSpec
    ) -> tuple[bool, str, dict[str, Any] | None]:
        held_out = self.frames(slot, self.config.guard_frames)
        reference = get_backend("onnxruntime").load(model, LoadOptions())
        candidate = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
        try:
            report = agreement(reference, candidate, held_out, preprocess)
        except BuildError as exc:
            return False, f"INT8 engine failed on held-out frames: {exc}", None
        finally:
            reference.close()
            candidate.close()
        ok, reason = check_int8(report, self.config.int8_agreement)
        return ok, reason, report.to_dict()

    def calibrate(self, slot: str, model: Path, preprocess: PreprocessSpec, frames: int) -> dict[str, Any]:
        """``calibrate`` command: entropy-calibrate ``model`` on ``frames`` live frames; store and reuse."""
        images = self.frames(slot, frames)
        if not images:
            raise BuildError(f"slot {slot!r} delivered no frames to calibrate on: check its streams")
        batches = collect_frames(images, len(images), preprocess)
        import onnxruntime as ort

        key = CalibrationKey.for_batches(
            model, batches, algorithm="entropy", backend="onnxruntime", backend_version=ort.__version__
        )
        with self._lock, tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            stored, reused = self.calibrations.get_or_calibrate(
                key, lambda: quantize_int8(model, Path(tmp), batches).ranges
            )
        return {
            "slot": slot,
            "frames": len(images),
            "key": key.digest(),
            "table": str(stored.table_path),
            "reused": reused,
            "tensors": len(stored.ranges),
        }
