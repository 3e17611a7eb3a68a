"""A deployment's steps on the device side: its BUILDING step (the engine of the manifest's build
request) and its activation (guarded by shadow and probation when the manifest asks, with the ONNX
Runtime fallback when a TensorRT engine fails to load).

One job (a delivered model into its slot), through the slot's owner
(:class:`~agent.runtime.slots.models.owner.SlotOwner`) and its lock; the guarded sequence itself is in
:mod:`agent.runtime.slots.guarded`. Delivery calls these steps (:mod:`agent.delivery.jobs.steps`).
What follows an engine that fails to load is :mod:`agent.engines.building.fallback`'s to decide.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import structlog

from agent.delivery.jobs.steps import ActivationRequest, BuildOutcome, JobReporter, no_build
from agent.engines.building.fallback import FAILED_AT, after_load_failure
from agent.engines.building.progress import ProgressTracker
from agent.engines.service import PreparedEngine
from agent.engines.sharing.cache import FleetEngineCache
from agent.errors import BuildError, EngineError
from agent.protocol.delivery_errors import JobCancelledError
from agent.protocol.runs import runs_of
from agent.runtime.slots.evidence import EvidenceStore
from agent.runtime.slots.guarded import GuardedSlot, GuardRun, activate_guarded
from agent.runtime.slots.loaded import ModelSource
from agent.runtime.slots.models.builds import heartbeat
from agent.runtime.slots.models.fleet_engines import (
    build_here,
    dropped_fleet_engine,
    offer_when_active,
    release_claim,
    release_job_claims,
)
from agent.runtime.slots.models.owner import SlotOwner
from agent.runtime.slots.models.sources import engine_report, engine_source, engine_summary, model_source
from agent.specs.build import BuildSpec

log = structlog.get_logger(__name__)


class SlotDeployments:
    """Builds and activates the models deployments deliver, one slot owner's worth."""

    def __init__(self, owner: SlotOwner, evidence: EvidenceStore | None = None) -> None:
        self._owner = owner
        #: Where shadow rejections keep their disagreement frames (the ``evidence`` command).
        self.evidence = evidence
        #: Engine cache key, build request and every engine of its set (itself first; several with
        #: ``build.devices``) of each engine built for a deployment, until activated.
        self._engine_keys: dict[Path, tuple[str, BuildSpec, list[PreparedEngine]]] = {}
        #: The shadow or probation running (or last run) per slot: telemetry and rollback read it.
        self.guard_runs: dict[str, GuardRun] = {}

    def build_delivered(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        """A deployment's BUILDING step: the manifest's build request, else the slot's configured one."""
        slot = reporter.slot or ""
        slot_config = self._owner.slot_configs.get(slot)
        spec = spec if spec is not None else (slot_config.build if slot_config else None)
        if spec is None or slot_config is None:
            return no_build(model, spec, reporter)
        preprocess = reporter.preprocess or slot_config.preprocess
        steps = 0
        tracker = ProgressTracker(time.monotonic())

        def progress(message: str) -> None:
            # The builder reports steps (plan, calibrate, build, cache), not a percentage: each step
            # moves the job's BUILDING progress part of the way towards done.
            nonlocal steps
            steps += 1
            reporter.progress(min(0.95, 1.0 - 0.7**steps))
            log.info("engine.build.progress", slot=slot, message=message)
            due = tracker.update(message, time.monotonic())
            if due is not None:
                reporter.build(due.as_dict())

        def beat() -> None:
            due = tracker.due(time.monotonic())
            if due is not None:
                reporter.build(due.as_dict())

        try:
            with (
                heartbeat(beat),
                FleetEngineCache.sharing(
                    reporter.share_engines, reporter.job_id, reporter.model_id, reporter.version
                ),
            ):
                prepared, *more = self._owner.engines.prepare_set(
                    slot, model, spec, preprocess, progress=progress, cancel=reporter.cancel
                )
        except BaseException as exc:
            release_job_claims(self._owner.engines, reporter.job_id or "", f"the job's build failed: {exc}")
            raise
        reporter.progress(1.0)
        self._engine_keys[prepared.artifact.engine_path] = (prepared.artifact.key, spec, [prepared, *more])
        effective = prepared.effective
        if spec.devices is not None or more:  # a build.devices set, or a device: auto combination
            effective = {**effective, "engines": [engine_summary(p.effective) for p in (prepared, *more)]}
        return BuildOutcome(
            engine_path=prepared.artifact.engine_path,
            backend=prepared.artifact.backend,
            effective=effective,
            load_extra=prepared.artifact.load_extra,
            providers=prepared.artifact.providers,
        )

    def activate_delivered(self, request: ActivationRequest) -> None:
        """A deployment's engine into its slot (raises EngineError: the old model keeps serving).

        Waits for the slot's start-up load first: one owner per slot. A build claim this device holds
        for the engine is released when the activation fails (the fleet's next asker builds it)."""
        built = self._engine_keys.get(request.engine_path)
        job_id = request.guard.job_id if request.guard is not None else ""
        try:
            offered = self._activate_delivered(request)
        except BaseException as exc:
            if built is not None:
                release_claim(self._owner.engines, built[0], f"the job's activation failed: {exc}")
            release_job_claims(self._owner.engines, job_id, f"the job's activation failed: {exc}")
            raise
        # Any other key this job claimed (an INT8 engine the check rejected, a set's engine the
        # activation replaced) will never be offered: the fleet stops waiting for it.
        keep = {offered} if offered is not None else set()
        release_job_claims(self._owner.engines, job_id, "the job went ACTIVE on another engine", keep=keep)

    def _activate_delivered(self, request: ActivationRequest) -> str | None:
        """Activate ``request``; returns the engine key ACTIVE now (the one offered), if any."""
        self._owner.wait_initial_load(request.slot)
        slot_config = self._owner.slot_configs[request.slot]
        current = self._owner.slots[request.slot].current
        base = current.source if current is not None else model_source(slot_config)
        built = self._engine_keys.pop(request.engine_path, None)
        source = replace(
            base,
            path=request.engine_path,
            model_id=request.model_id,
            version=request.version,
            backend=request.backend,
            preprocess=request.preprocess or base.preprocess,
            postprocess=request.postprocess or base.postprocess,
            providers=request.providers or base.providers,
            extra=tuple(request.load_extra.items()),
            sha256=request.sha256,
            model_path=request.model_path,
            engine_key=built[0] if built else None,
            build=built[1] if built else None,
            report=None,
            engines=(),
            share_engines=request.share_engines,
            runs=runs_of(None),
        )
        if built is not None:
            # A set's first engine is the request's; the others were built beside it (build.devices).
            first, *more = built[2]
            source = replace(source, report=engine_report(first.effective), runs=runs_of(first.effective))
            source = replace(source, engines=tuple(engine_source(source, p) for p in more))
        try:
            self._activate_request(request, source, guarded_ok=current is not None)
        except EngineError as exc:
            spec = built[1] if built else None
            backends = (source.backend, *(e.backend for e in source.engines))
            fleet_engine = dropped_fleet_engine(self._owner.engines, source, exc)
            step = after_load_failure(spec, backends, str(exc), fleet_engine=fleet_engine)
            if step.action == "build_here" and step.spec is not None:
                here = build_here(self._owner.engines, request, source, step.spec, exc)
                source = engine_source(replace(source, engines=()), here)
                self._activate_request(request, source, guarded_ok=current is not None)
                offer_when_active(self._owner.engines, request, source, guarded=current is not None)
                return source.engine_key
            if step.action == "onnxruntime" and step.spec is not None:
                fallback = self._load_fallback_source(request, source, step.spec, exc)
                self._activate_request(request, fallback, guarded_ok=current is not None)
                return None
            if step.reason:
                raise EngineError(step.reason) from exc
            raise
        # ACTIVE through shadow and probation (when guarded): offered to the fleet if it shares engines.
        offer_when_active(self._owner.engines, request, source, guarded=current is not None)
        return source.engine_key

    def _activate_request(self, request: ActivationRequest, source: ModelSource, *, guarded_ok: bool) -> None:
        guarded = request.guard is not None and (request.shadow is not None or request.probation_s > 0)
        # An empty slot has nothing to compare with and nothing to fall back to: no shadow, no probation.
        if not guarded or not guarded_ok:
            # A way back (manifest ``rollback``) is recorded as a rollback: what it leaves is no target.
            self._owner.activate(request.slot, source, origin="rollback" if request.rollback else "delivery")
            return
        with self._owner.lock(request.slot):
            activate_guarded(self._guarded_slot(request.slot), request, source)

    def _load_fallback_source(
        self, request: ActivationRequest, failed: ModelSource, spec: BuildSpec, error: EngineError
    ) -> ModelSource:
        """The ONNX Runtime engine to activate instead of a TensorRT engine that failed to load or
        validate (the job is told its new ``effective``). Raises EngineError when that build fails
        too (the job ends ROLLED_BACK naming both), JobCancelledError when the job was cancelled."""
        cancel = request.guard.cancel if request.guard is not None else None
        log.warning("slot.tensorrt_load_failed", slot=request.slot, error=str(error), fallback="onnxruntime")
        try:
            prepared = self._owner.engines.prepare_fallback(
                request.slot,
                request.model_path,
                spec,
                failed.preprocess,
                str(error),
                progress=lambda message: log.info(
                    "engine.build.progress", slot=request.slot, message=message
                ),
                cancel=cancel,
            )
        except BuildError as exc:
            if cancel is not None and cancel.is_set():
                raise JobCancelledError(
                    f"slot {request.slot}: ONNX Runtime fallback build cancelled"
                ) from exc
            raise EngineError(
                f"{FAILED_AT['load']}: {error}; the ONNX Runtime fallback failed too: {exc}"
            ) from exc
        if request.on_fallback is not None:
            request.on_fallback(prepared.effective)
        return engine_source(replace(failed, engines=()), prepared)

    def _guarded_slot(self, name: str) -> GuardedSlot:
        owner = self._owner
        return GuardedSlot(
            slot=owner.slots[name],
            latest_frame=lambda: owner.latest_frame(name),
            record=lambda source, loaded: owner.record(name, source, loaded, "delivery"),
            activated=owner.activated,
            runs=self.guard_runs,
            evidence=self.evidence,
        )

    def guard_stats(self) -> dict[str, float]:
        """Per slot, for up/telemetry: whether a shadow or probation runs, and its figures."""
        stats: dict[str, float] = {}
        for name in self._owner.slots:
            run = self.guard_runs.get(name)
            fields = run.telemetry() if run is not None and not run.done.is_set() else {}
            stats[f"{name}.shadow.active"] = fields.pop("shadow.active", 0.0)
            stats[f"{name}.probation.active"] = fields.pop("probation.active", 0.0)
            stats.update({f"{name}.{key}": value for key, value in fields.items()})
        return stats
