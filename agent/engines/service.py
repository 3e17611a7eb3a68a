"""The agent's side of engine builds: a slot's model and build request in, a loadable engine out.

Wraps :class:`agent.engines.building.builder.EngineBuilder` (plan, cache, worker) with what only the running
agent has: live frames of the slot's streams, for calibration (``calibration.kind: stream``) and
for the INT8 accuracy guard. An INT8 engine whose top-1 agreement with FP32 on held-out frames is
below ``engines.int8_agreement`` never goes live: the build falls back to FP16 and says why. What
follows a failed engine is :mod:`agent.engines.building.fallback`'s to decide; this module carries it out.
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
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.fallback import after_int8_check, after_int8_rejected
from agent.engines.calibration.data import PROGRESS_LINES
from agent.engines.calibration.int8 import quantize_int8
from agent.engines.calibration.store import CalibrationKey, CalibrationStore, collect_frames
from agent.engines.guard.agreement import agreement, check_int8
from agent.engines.guard.memo import GuardMemo, Verdict
from agent.engines.placement.choice import (
    CandidateTiming,
    CombinationTiming,
    choose_placement,
    combinations_to_try,
    ranked_accelerators,
)
from agent.engines.placement.devices import engine_devices, placement_candidates
from agent.engines.placement.measure import measure_candidates, measure_combinations
from agent.engines.settings import EngineConfig
from agent.errors import BuildError, EngineError
from agent.model_contract.model_facts import model_facts
from agent.protocol.engines import DropStage
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec

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
        #: The INT8 guard's verdicts by engine file, beside the cache: a rollback does not check again.
        self.guard_memo = GuardMemo(builder.cache.root)
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
        """Build (or find) the engine for ``model``; INT8 only if it passes the accuracy guard.

        One engine: ``device: auto`` keeps the best candidate timed alone here; :meth:`prepare_set`
        also times candidate sets together and may keep several engines."""
        say = progress or (lambda _msg: None)
        return self._prepare_placed(slot, model, spec, preprocess, combine=False, say=say, cancel=cancel)[0]

    def _prepare_placed(
        self,
        slot: str,
        model: Path,
        spec: BuildSpec | None,
        preprocess: PreprocessSpec,
        *,
        combine: bool,
        say: Progress,
        cancel: threading.Event | None,
    ) -> list[PreparedEngine]:
        """The engine(s) :meth:`_placed_build` keeps, each through the INT8 guard; a ``device: auto``
        choice puts ``placement_choice`` on the first and, for a set, ``engine_device`` and
        ``engine_reason`` on each (as ``build.devices`` does)."""
        calibration = self._stream_calibration(slot, spec, preprocess, say)
        kept, placement = self._placed_build(
            slot,
            model,
            spec,
            calibration=calibration,
            preprocess=preprocess,
            combine=combine,
            say=say,
            cancel=cancel,
        )
        prepared: list[PreparedEngine] = []
        for index, (device, artifact) in enumerate(kept):
            extra: dict[str, Any] = {}
            if placement is not None:
                extra["requested"] = {**artifact.effective.get("requested", {}), "device": "auto"}
                if index == 0:
                    extra["placement_choice"] = placement
            if len(kept) > 1 and placement is not None:
                reason = f"device auto kept it: {placement['reason']}"
                extra.update(engine_device=device, engine_reason=reason)
            # An INT8 engine the guard rejects is rebuilt at FP16 on the device placement kept.
            engine_spec = spec.model_copy(update={"device": device}) if spec is not None and device else spec
            one = self._int8_guarded(
                slot,
                model,
                engine_spec,
                artifact,
                {**artifact.effective, **extra},
                preprocess=preprocess,
                say=say,
                cancel=cancel,
            )
            # A guard rebuild reports afresh: what placement decided still holds for this engine.
            prepared.append(PreparedEngine(one.artifact, {**one.effective, **extra}))
        return prepared

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
        known = self.guard_memo.known(artifact.key, artifact.engine_path, self.config.int8_agreement)
        if known is not None:
            # Checked on this device before (a rollback, a restart): its verdict, not a second check.
            ok, reason, report = known
            say(f"int8 guard (known for this engine, not run again): {reason}")
        else:
            artifact, effective, (ok, reason, report) = self._check_int8(
                slot, model, spec, artifact, effective, preprocess=preprocess, say=say, cancel=cancel
            )
            self.guard_memo.remember(artifact.key, artifact.engine_path, (ok, reason, report))
            say(f"int8 guard: {reason}")
        effective["int8_guard"] = {"passed": ok, "reason": reason, **(report or {})}
        if ok:
            return PreparedEngine(artifact, effective)
        log.warning("engine.int8.rejected", slot=slot, reason=reason)
        # This device goes on with another engine: the fleet stops waiting for this key's offer.
        self.builder.release_claim(artifact.key, f"the INT8 check rejected it: {reason}")
        step = after_int8_rejected(spec, artifact.effective)
        fp16 = step.spec or BuildSpec()
        if step.failure is not None:
            artifact = self.builder.build_fallback(
                model, fp16, step.failure, preprocess=preprocess, progress=say, cancel=cancel
            )
        else:
            artifact = self.builder.build(model, fp16, preprocess=preprocess, progress=say, cancel=cancel)
        # The rebuild's own request is the FP16 fallback: the job reports what the operator asked.
        effective = {
            **artifact.effective,
            "requested": effective.get("requested", artifact.effective.get("requested")),
            "int8_guard": effective["int8_guard"],
            "fallback_reason": reason,
        }
        return PreparedEngine(artifact, effective)

    def _check_int8(
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
    ) -> tuple[EngineArtifact, dict[str, Any], Verdict]:
        """The guard run on ``artifact`` (or on its local rebuild when it was a fleet engine that
        failed here): the engine checked, its effective report, and the verdict."""
        try:
            ok, reason, report = self._guard(slot, model, artifact, preprocess)
            failed: Exception | None = None if ok else EngineError(f"INT8 accuracy guard here: {reason}")
            stage: DropStage = "agreement"
        except EngineError as exc:  # it does not load
            failed, stage = exc, "load"
        # A fleet engine that fails here is dropped (and withdrawn) first; then the owner decides.
        dropped = failed is not None and self.builder.dropped_from_fleet(artifact, failed, stage=stage)
        step = after_int8_check(failed=failed is not None, stage=stage, fleet_engine=dropped)
        if step is not None and step.action == "build_here":
            calibration = self._stream_calibration(slot, spec, preprocess, say)
            artifact = self.builder.build(
                model, spec, calibration=calibration, preprocess=preprocess, progress=say, cancel=cancel
            )
            effective = {**artifact.effective, "fleet_engine_failed": str(failed)[:300]}
            ok, reason, report = self._guard(slot, model, artifact, preprocess)
        elif step is not None and step.action == "give_up" and failed is not None:
            self.builder.release_claim(artifact.key, f"the INT8 engine does not load here: {failed}")
            raise failed
        return artifact, effective, (ok, reason, report)

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
        never serves part of what the operator asked for without saying so. ``devices`` unset and
        ``device: auto``: the set placement by measurement keeps (one engine, or a combination timed
        together). ``devices: auto`` is every usable device, untimed: the operator asked for all.
        """
        say = progress or (lambda _msg: None)
        if spec is None or spec.devices is None:
            return self._prepare_placed(slot, model, spec, preprocess, combine=True, say=say, cancel=cancel)
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
        combine: bool,
        say: Progress,
        cancel: threading.Event | None,
    ) -> tuple[list[tuple[str | None, EngineArtifact]], dict[str, Any] | None]:
        """``device: auto`` with several candidate devices: build each, time each alone on the slot's
        live frames and (``combine``) the sets worth trying together, keep what :func:`choose_placement`
        picks: [(device, artifact)], best first, and the report for job status. Otherwise, or when
        nothing could be timed, the planner's one engine (device None)."""

        def planned() -> list[tuple[str | None, EngineArtifact]]:
            artifact = self.builder.build(
                model, spec, calibration=calibration, preprocess=preprocess, progress=say, cancel=cancel
            )
            return [(None, artifact)]

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
        together: list[CombinationTiming] = []
        if combine:
            together, set_failed = measure_combinations(
                built,
                combinations_to_try(timed),
                tensors,
                seconds=self.config.placement_seconds,
                say=say,
                cancel=cancel,
            )
            failed.update(set_failed)
        choice = choose_placement(
            timed, spec.prefer, dla_max_slowdown=self.config.placement_dla_max_slowdown, combinations=together
        )
        options = [CombinationTiming.solo(t) for t in ranked_accelerators(timed)] + together
        report.update(
            combinations=[o.as_dict() for o in options],
            chosen=list(choice.devices),
            combined_fps=round(choice.fps, 2),
            reason=choice.reason,
        )
        say(f"placement: {choice.reason}")
        log.info("engine.placement.chosen", slot=slot, chosen=choice.devices, reason=choice.reason)
        return [(device, built[device]) for device in choice.devices], report

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
        """Build each candidate of ``specs`` (label -> spec) and time it alone on ``frames`` for
        ``engines.placement_seconds``: the artifacts, the timings, and why a candidate failed."""
        return measure_candidates(
            self.builder,
            model,
            specs,
            frames,
            seconds=self.config.placement_seconds,
            calibration=calibration,
            preprocess=preprocess,
            say=say,
            cancel=cancel,
        )

    def _stream_calibration(
        self, slot: str, spec: BuildSpec | None, preprocess: PreprocessSpec, say: Progress
    ) -> list[npt.NDArray[Any]] | None:
        if spec is None or spec.calibration is None or spec.calibration.kind != "stream":
            return None
        wanted = spec.calibration.frames
        say(f"calibration: collecting {wanted} frames of slot {slot}")
        # Taken in parts, each counted (``collected D/T frames``): collecting is most of a stream
        # calibration's time, and the operator reads its progress. A part that comes back short
        # (the stream ended or timed out) ends the collection with what arrived.
        part = max(1, -(-wanted // PROGRESS_LINES))
        images: list[npt.NDArray[np.uint8]] = []
        while len(images) < wanted:
            asked = min(part, wanted - len(images))
            got = self.frames(slot, asked)
            images.extend(got[:asked])
            say(f"calibration: collected {len(images)}/{wanted} frames of slot {slot}")
            if len(got) < asked:
                break
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
