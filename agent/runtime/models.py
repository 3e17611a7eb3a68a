"""What every slot runs: the model chosen at start, builds, activations recorded in state.json,
hot-swaps, deployments and rollbacks.

The composition root (:mod:`agent.app`) owns the components; this owns the decisions about models.
Every activation goes through :meth:`SlotModels.activate`: the slot loads and validates the model
off the frame path, and the result is recorded (atomically) in state.json before anyone is told.

One job (every decision about which model a slot runs: start-up choice, builds, deployments with
shadow/probation and their fallbacks, rollbacks, state.json), about 600 lines: each path must take
the slot's one owner lock and record state.json the same way; the guarded sequence itself is in
:mod:`agent.runtime.guarded`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import TypeAdapter

from agent.backends.onnxruntime import interim_providers
from agent.camera.preprocess_spec import PreprocessSpec
from agent.config import SlotConfig
from agent.delivery.commands import NoSuchSlotError
from agent.delivery.errors import JobCancelledError
from agent.delivery.steps import ActivationRequest, BuildOutcome, JobReporter, no_build
from agent.engines.build_progress import ProgressTracker
from agent.engines.fleet_cache import ASKING_THE_FLEET, FleetEngineCache
from agent.engines.plan import FAILED_AT, load_fallback
from agent.engines.service import EngineService, PreparedEngine
from agent.engines.spec import BuildSpec
from agent.errors import AgentError, BuildError, DiskFullError, EngineError
from agent.fsutil import sha256_file
from agent.postprocess.spec import PostprocessSpec
from agent.protocol.command_args import CalibrateArgs
from agent.runtime.evidence import EvidenceStore
from agent.runtime.fleet_engines import offer_when_active, rebuilt_here
from agent.runtime.guarded import GuardedSlot, GuardRun, activate_guarded
from agent.runtime.loaded import EngineReport, LoadedModel, ModelSource
from agent.runtime.probation import ProbationRun
from agent.runtime.slot import ModelSlot
from agent.runtime.slot_builds import SlotBuilds, heartbeat
from agent.state import ModelRecord, StateFile, record_activation, record_config_model, record_rollback
from agent.telemetry import Metrics

log = structlog.get_logger(__name__)

Origin = Literal["config", "delivery", "rollback"]
#: How long a deployment or rollback waits for the slot's start-up load (which may build an engine).
INITIAL_LOAD_WAIT_S = 600.0
#: How long a ``rollback`` during probation waits for the swap back and the rejected model's last result.
ROLLBACK_WAIT_S = 15.0
_POSTPROCESS: TypeAdapter[PostprocessSpec] = TypeAdapter(PostprocessSpec)


def model_source(slot: SlotConfig) -> ModelSource:
    """What to load for a configured slot."""
    return ModelSource(
        path=slot.model,
        model_id=slot.model_id or slot.model.stem,
        version=slot.version,
        backend=slot.backend,
        providers=tuple(slot.providers),
        intra_op_threads=slot.intra_op_threads,
        preprocess=slot.preprocess,
        postprocess=slot.postprocess,
        max_batch=slot.max_batch,
        allow_spinning=slot.allow_spinning,
    )


class NoRollbackTargetError(AgentError):
    """``rollback`` on a slot with no older model to go back to (never had one, or already rolled back)."""

    code = "no_rollback_target"


class SlotModels:
    """The models of every slot, and the one place that changes them."""

    def __init__(
        self,
        slots: dict[str, ModelSlot],
        slot_configs: dict[str, SlotConfig],
        state_file: StateFile,
        engines: EngineService,
        metrics: Metrics,
        *,
        latest_frame: Callable[[str], npt.NDArray[np.uint8] | None],
        on_activated: Callable[[], None],
        evidence: EvidenceStore | None = None,
    ) -> None:
        self.slots = slots
        #: Where shadow rejections keep their disagreement frames (the ``evidence`` command).
        self.evidence = evidence
        self.slot_configs = slot_configs
        self.state_file = state_file
        self.state = state_file.load()
        self.engines = engines
        self.metrics = metrics
        self._latest_frame = latest_frame
        self._on_activated = on_activated
        self._state_lock = threading.Lock()
        self._configured: dict[str, tuple[ModelSource, BuildSpec | None, str | None]] = {}
        self._deferred_builds: list[tuple[str, ModelSource, BuildSpec]] = []
        #: Engine cache key, build request and every engine of its set (itself first; several with
        #: ``build.devices``) of each engine built for a deployment, until activated.
        self._engine_keys: dict[Path, tuple[str, BuildSpec, list[PreparedEngine]]] = {}
        self._swap_threads: list[threading.Thread] = []
        # One owner per slot: a slot's activations (load + state.json record) never interleave, and
        # nothing but the start-up load touches a slot before that load is over. A deployment resumed
        # at start-up (its retained manifest arrives while the first model loads) would otherwise
        # activate and then be overwritten by the start-up load, or race it for state.json.
        self._slot_locks = {name: threading.Lock() for name in slots}
        self._initial_done = {name: threading.Event() for name in slots}
        #: The shadow or probation running (or last run) per slot: telemetry and rollback read it.
        self._guard_runs: dict[str, GuardRun] = {}
        #: Builds a slot started itself (start-up, reload), for up/info; progress republishes it.
        self.builds = SlotBuilds(on_activated)
        #: The interim model (the ONNX model on ONNX Runtime) a slot serves while its engine builds.
        self._interim: dict[str, LoadedModel] = {}
        metrics.add_collector(self._guard_stats, prefix="slot.")
        self.protect_engines()

    def start_deferred_builds(self) -> None:
        """Builds that need live frames (stream calibration) start once the streams run."""
        for name, source, build in self._deferred_builds:
            self.start_swap(name, source, build)
        self._deferred_builds.clear()

    def reload(self, slot_configs: dict[str, SlotConfig]) -> list[str]:
        """Hot-swap every slot whose configured model, file or build request changed (or that is
        empty); return their names. The swaps run in the background and log their outcome."""
        swapping = []
        for name, slot_config in slot_configs.items():
            if name not in self.slots:
                continue
            source = model_source(slot_config)
            wanted = (source, slot_config.build, _sha_or_none(source.path))
            if self._configured.get(name) == wanted and self.slots[name].current is not None:
                continue
            self._configured[name] = wanted
            self.start_swap(name, source, slot_config.build)
            swapping.append(name)
        self.slot_configs = {
            **self.slot_configs,
            **{k: v for k, v in slot_configs.items() if k in self.slots},
        }
        return swapping

    def join_swaps(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for swaps in progress (at shutdown)."""
        deadline = time.monotonic() + timeout
        for thread in self._swap_threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    def load_initial(self, name: str, slot_config: SlotConfig) -> None:
        """Come back on what the slot ran before the restart, else the config's model, else a fallback.

        A delivered (or rolled-back-to) model outlives restarts until the operator changes the model
        file the config names; then the config wins. Deployments and rollbacks of the slot wait for it.
        """
        try:
            self._load_initial(name, slot_config)
        finally:
            self._initial_done[name].set()

    def _load_initial(self, name: str, slot_config: SlotConfig) -> None:
        configured = model_source(slot_config)
        config_sha = _sha_or_none(configured.path)
        saved = self.state.slot(name)
        # (source, build request, origin), in order of preference.
        candidates: list[tuple[ModelSource, BuildSpec | None, Origin]] = []
        if saved.active is not None and saved.active.origin != "config" and saved.config_sha256 == config_sha:
            candidates.append(
                (_from_record(configured, saved.active), _build_of(saved.active), saved.active.origin)
            )
        candidates.append((configured, slot_config.build, "config"))
        candidates.extend(
            (_from_record(configured, record), _build_of(record), record.origin)
            for record in (saved.active, saved.last_known_good)
            if record is not None
        )
        self._configured[name] = (configured, slot_config.build, config_sha)
        tried: set[Path] = set()
        problems: dict[Path, str] = {}  # why each candidate did not serve: says why an empty slot is empty
        for candidate, build, origin in candidates:
            if candidate.path in tried or not candidate.path.exists():
                problems.setdefault(candidate.path, f"model file {candidate.path} not found")
                continue
            tried.add(candidate.path)
            source = candidate
            try:
                if build is not None and _needs_frames(build):
                    # Calibration needs live frames: serve the ONNX model first, build once streams run.
                    self._deferred_builds.append((name, candidate, build))
                    self._interim[name] = self.activate(name, candidate, origin=origin, must_record=False)
                elif build is not None and self.engines.config.serve_while_building:
                    # Serve at once: the engine comes from the cache, or builds while the ONNX model serves.
                    self._serve_while_building(name, candidate, build, origin)
                else:
                    # A built engine comes back from the engine cache (rebuilt only if it was evicted).
                    source = self.prepared(name, candidate, build)
                    self.activate(name, source, origin=origin, must_record=False)
                if origin != "config" or candidate.path != configured.path:
                    log.warning("agent.slot.restored", slot=name, model=source.model_id, ver=source.version)
                break
            except (EngineError, BuildError) as exc:
                log.error("agent.slot.initial_failed", slot=name, model=str(source.path), error=str(exc))
                problems[candidate.path] = f"model {candidate.path} failed to load: {exc}"
        if self.slots[name].current is None:
            _report_empty(self.slots[name], problems)
        with self._state_lock:
            changed = record_config_model(self.state, name, config_sha)
            try:
                self.state_file.save(changed)
            except OSError as exc:
                # A full state disk must not keep the device from serving: the next start chooses
                # from the same state.json again, so it comes back on the same model.
                log.error("agent.state.not_recorded", slot=name, error=str(exc))
            else:
                self.state = changed

    def _serve_while_building(
        self, name: str, candidate: ModelSource, build: BuildSpec, origin: Origin
    ) -> None:
        """Activate ``candidate``'s engine if the cache has it, else serve the ONNX model on ONNX
        Runtime (:func:`interim_source`) and hot-swap to the engine once built and validated.

        Raises what :meth:`prepared` raises when it fails before any build began (the caller tries
        the next candidate); a build that fails later leaves the interim model serving."""
        handoff = _Handoff()

        def watch(message: str) -> None:
            # A local miss: the fleet is asked (a bounded wait, then a download) or a build starts.
            if message.startswith(("cache miss", ASKING_THE_FLEET)):
                handoff.building.set()

        def build_engine() -> None:
            try:
                engine: ModelSource | BaseException = self.prepared(name, candidate, build, watch=watch)
            except (EngineError, BuildError) as exc:
                engine = exc
            if handoff.hand_over(engine):
                return  # the caller waits for it: a cache hit, or a failure before any build
            self._swap_from_interim(name, engine, origin)

        thread = threading.Thread(target=build_engine, name=f"build-{name}", daemon=True)
        self._swap_threads.append(thread)
        thread.start()
        outcome = handoff.wait()
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            self.activate(name, outcome, origin=origin, must_record=False)
            return
        interim = interim_source(candidate)
        try:
            self._serve_interim(name, interim)
        except EngineError as exc:
            # The build goes on and swaps in when done; until then the slot has nothing to serve.
            log.error("slot.interim.failed", slot=name, model=str(candidate.path), error=str(exc))
            return
        log.warning(
            "slot.interim.serving",
            slot=name,
            model=candidate.model_id,
            providers=[p if isinstance(p, str) else p[0] for p in interim.providers],
            why="its engine is not in the cache: it builds meanwhile, then swaps in",
        )

    def _serve_interim(self, name: str, source: ModelSource) -> None:
        """Serve ``source`` without recording it in state.json: an interim model is never what a
        restart comes back on (it chooses, and builds, from the same state.json again). Marked as
        the interim before up/info is published, so that says ``serving: interim``."""
        with self._slot_locks[name]:
            self._interim[name] = self.slots[name].load(source, self._latest_frame(name))
        self._on_activated()

    def _swap_from_interim(self, name: str, engine: ModelSource | BaseException, origin: Origin) -> None:
        """The engine built while the interim model served: swapped in, if the slot still serves that."""
        if isinstance(engine, BaseException):
            log.error("slot.interim.build_failed", slot=name, error=str(engine), serving="interim")
            self.metrics.counter(f"slot.{name}.swap_failures").inc()
            return
        with self._slot_locks[name]:
            interim = self._interim.get(name)
            current = self.slots[name].current
            if current is not None and current is not interim:
                # A deployment or rollback activated since: its model wins, the built engine stays cached.
                log.warning("slot.interim.superseded", slot=name, serving=current.ref.model_id)
                return
            try:
                self._activate(name, engine, origin, must_record=False)
            except EngineError as exc:
                log.error("slot.interim.swap_rejected", slot=name, error=str(exc), serving="interim")
                self.metrics.counter(f"slot.{name}.swap_failures").inc()
                return
            self._interim.pop(name, None)  # closed: nothing may hold on to it
        log.info("slot.interim.swapped", slot=name, model=engine.model_id, backend=engine.backend)

    def serving(self, name: str) -> Literal["requested", "interim"] | None:
        """For up/info: ``interim`` while the slot serves its ONNX model as its engine builds."""
        current = self.slots[name].current
        if current is None:
            return None
        return "interim" if current is self._interim.get(name) else "requested"

    def wait_initial_load(self, name: str, timeout: float = INITIAL_LOAD_WAIT_S) -> None:
        """Block until the start-up load of slot ``name`` is over (EngineError after ``timeout``)."""
        if not self._initial_done[name].wait(timeout):
            raise EngineError(
                f"slot {name}: its start-up model load is still running after {timeout:.0f} s; "
                "the deployment waits for no longer: publish it again once the slot serves"
            )

    def activate(
        self, name: str, source: ModelSource, *, origin: Origin = "config", must_record: bool = True
    ) -> LoadedModel:
        """Load ``source`` into slot ``name`` and record it in state.json, as the slot's only owner.

        ``must_record``: the record is written before the model serves, and a disk that refuses it
        (OSError) leaves the previous model serving: a deployment or rollback that could not be
        recorded would be undone by the next restart. False (the start-up load, a config reload): the
        model serves all the same and a failed record is logged, since the next start makes the
        same choice from the same state.json and config.
        """
        with self._slot_locks[name]:
            return self._activate(name, source, origin, must_record)

    def _activate(self, name: str, source: ModelSource, origin: Origin, must_record: bool) -> LoadedModel:
        sample = self._latest_frame(name)
        slot = self.slots[name]
        if must_record:
            loaded = slot.load(source, sample, before_swap=lambda c: self._record(name, source, c, origin))
        else:
            loaded = slot.load(source, sample)
            try:
                self._record(name, source, loaded, origin)
            except OSError as exc:
                log.error("agent.state.not_recorded", slot=name, model=loaded.ref.model_id, error=str(exc))
        self._activated()
        return loaded

    def _activated(self) -> None:
        """A model serves for good: its engines are protected, and whoever publishes up/info is told."""
        self.protect_engines()
        self._on_activated()

    def _record(self, name: str, source: ModelSource, loaded: LoadedModel, origin: Origin) -> None:
        """Record ``loaded`` as the slot's active model in state.json (its predecessor becomes the
        last-known-good); OSError when the disk refuses it (nothing changes then)."""
        record = ModelRecord(
            model_id=loaded.ref.model_id,
            version=loaded.ref.version,
            sha256=loaded.ref.sha256,
            path=str(source.model_path or source.path),
            backend=source.backend,
            engine_key=source.engine_key,
            build=source.build.model_dump(mode="json") if source.build is not None else None,
            preprocess=source.preprocess.model_dump(mode="json"),
            postprocess=_POSTPROCESS.dump_python(source.postprocess, mode="json"),  # type: ignore[arg-type]
            origin=origin,
            share_engines=source.share_engines,
        )
        # A rollback leaves no rollback target behind: a second one must not swap forward. (A restart
        # that restores a rolled-back model finds no target already, so the same rule holds there.)
        record_change = record_rollback if origin == "rollback" else record_activation
        with self._state_lock:
            changed = record_change(self.state, name, record)
            # Kept in memory only once on disk: what a restart brings back is what this process says.
            self.state_file.save(changed)
            self.state = changed

    def start_swap(self, name: str, source: ModelSource, build: BuildSpec | None) -> None:
        thread = threading.Thread(
            target=self._swap, args=(name, source, build), name=f"swap-{name}", daemon=True
        )
        self._swap_threads.append(thread)
        thread.start()

    def _swap(self, name: str, source: ModelSource, build: BuildSpec | None = None) -> None:
        try:
            self.activate(name, self.prepared(name, source, build), must_record=False)
        except (EngineError, BuildError) as exc:
            log.error("slot.swap.rejected", slot=name, error=str(exc))
            self.metrics.counter(f"slot.{name}.swap_failures").inc()

    def prepared(
        self,
        name: str,
        source: ModelSource,
        build: BuildSpec | None,
        *,
        watch: Callable[[str], None] | None = None,
    ) -> ModelSource:
        """``source`` as the engine its build request asks for (built, or found in the cache).

        Its progress goes to up/info (``building``) while it runs; ``watch`` sees every line too."""
        if build is None:
            return source
        with self.builds.building(name, source.model_id, source.version) as published:

            def progress(message: str) -> None:
                log.info("engine.build.progress", slot=name, message=message)
                published(message)
                if watch is not None:
                    watch(message)

            with FleetEngineCache.sharing(source.share_engines, None):
                engines = self.engines.prepare_set(
                    name, source.path, build, source.preprocess, progress=progress
                )
        for prepared in engines:
            artifact = prepared.artifact
            log.info(
                "engine.ready",
                slot=name,
                key=artifact.key,
                cache_hit=artifact.cache_hit,
                effective=prepared.effective,
            )
        base = replace(source, sha256=sha256_file(source.path), model_path=source.path, build=build)
        first, *rest = (engine_source(base, prepared) for prepared in engines)
        return replace(first, engines=tuple(rest))

    def build_delivered(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        """A deployment's BUILDING step: the manifest's build request, else the slot's configured one."""
        slot = reporter.slot or ""
        slot_config = self.slot_configs.get(slot)
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

        with heartbeat(beat), FleetEngineCache.sharing(reporter.share_engines, reporter.job_id):
            prepared, *more = self.engines.prepare_set(
                slot, model, spec, preprocess, progress=progress, cancel=reporter.cancel
            )
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

    def calibrate(self, args: CalibrateArgs) -> dict[str, Any]:
        """``calibrate`` command: ``{"slot": S, "frames": N}`` from the slot's live streams."""
        slot, frames = args.slot, args.frames
        self._check_slot(slot)
        current = self.slots[slot].current
        if current is None:
            raise AgentError(f"slot {slot!r} has no active model to calibrate")
        model = current.source.model_path or current.source.path
        return self.engines.calibrate(slot, model, current.source.preprocess, frames)

    def activate_delivered(self, request: ActivationRequest) -> None:
        """A deployment's engine into its slot (raises EngineError: the old model keeps serving).

        Waits for the slot's start-up load first: one owner per slot."""
        self.wait_initial_load(request.slot)
        slot_config = self.slot_configs[request.slot]
        current = self.slots[request.slot].current
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
        )
        if built is not None:
            # A set's first engine is the request's; the others were built beside it (build.devices).
            first, *more = built[2]
            source = replace(source, report=engine_report(first.effective))
            source = replace(source, engines=tuple(engine_source(source, p) for p in more))
        try:
            self._activate_request(request, source, guarded_ok=current is not None)
        except EngineError as exc:
            spec = built[1] if built else None
            here = rebuilt_here(self.engines, request, source, spec, exc)  # a fleet engine that failed
            if here is not None:
                source = engine_source(replace(source, engines=()), here)
                self._activate_request(request, source, guarded_ok=current is not None)
                offer_when_active(self.engines, request, source, guarded=current is not None)
                return
            decision = load_fallback(spec, (source.backend, *(e.backend for e in source.engines)))
            if decision == "not_tensorrt" or spec is None:
                raise
            if decision == "none":
                raise EngineError(
                    f"{FAILED_AT['load']} and the build spec says fallback: none, so no ONNX Runtime "
                    f"engine is built instead: {exc}"
                ) from exc
            fallback = self._load_fallback_source(request, source, spec, exc)
            self._activate_request(request, fallback, guarded_ok=current is not None)
            return
        offer_when_active(
            self.engines, request, source, guarded=current is not None
        )  # ACTIVE through shadow and probation

    def _activate_request(self, request: ActivationRequest, source: ModelSource, *, guarded_ok: bool) -> None:
        guarded = request.guard is not None and (request.shadow is not None or request.probation_s > 0)
        # An empty slot has nothing to compare with and nothing to fall back to: no shadow, no probation.
        if not guarded or not guarded_ok:
            self.activate(request.slot, source, origin="delivery")
            return
        with self._slot_locks[request.slot]:
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
            prepared = self.engines.prepare_fallback(
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
        return GuardedSlot(
            slot=self.slots[name],
            latest_frame=lambda: self._latest_frame(name),
            record=lambda source, loaded: self._record(name, source, loaded, "delivery"),
            activated=self._activated,
            runs=self._guard_runs,
            evidence=self.evidence,
        )

    def _guard_stats(self) -> dict[str, float]:
        """Per slot, for up/telemetry: whether a shadow or probation runs, and its figures."""
        stats: dict[str, float] = {}
        for name in self.slots:
            run = self._guard_runs.get(name)
            fields = run.telemetry() if run is not None and not run.done.is_set() else {}
            stats[f"{name}.shadow.active"] = fields.pop("shadow.active", 0.0)
            stats[f"{name}.probation.active"] = fields.pop("probation.active", 0.0)
            stats.update({f"{name}.{key}": value for key, value in fields.items()})
        return stats

    def slot_specs(self, slot: str) -> tuple[PreprocessSpec, PostprocessSpec] | None:
        if slot not in self.slots:
            return None
        current = self.slots[slot].current
        if current is not None:
            return current.source.preprocess, current.source.postprocess  # type: ignore[return-value]
        slot_config = self.slot_configs[slot]
        return slot_config.preprocess, slot_config.postprocess

    def protect_engines(self) -> None:
        """The engine cache's eviction never removes an active or last-known-good engine."""
        with self._state_lock:
            records = [r for s in self.state.slots.values() for r in (s.active, s.last_known_good) if r]
        keys = {r.engine_key for r in records if r.engine_key}
        # state.json names a set's first engine; the others of the sets now serving are kept too.
        for slot in self.slots.values():
            current = slot.current
            keys.update(
                e.source.engine_key for e in (current.engines if current else ()) if e.source.engine_key
            )
        self.engines.builder.protect(keys)

    def protected_models(self) -> set[str]:
        with self._state_lock:
            records = [r for s in self.state.slots.values() for r in (s.active, s.last_known_good) if r]
        return {r.sha256 for r in records}

    def rollback(self, slot: str) -> dict[str, Any]:
        """``rollback`` command: make the slot's last-known-good model active again.

        During a probation the last-known-good model is still loaded: the probation ends at once,
        swapping back to it (the job ends ROLLED_BACK operator_rollback)."""
        self._check_slot(slot)
        run = self._guard_runs.get(slot)
        if isinstance(run, ProbationRun) and run.end_by_operator(ROLLBACK_WAIT_S):
            current = self.slots[slot].current
            log.warning("slot.rolled_back", slot=slot, during="probation")
            return {
                "slot": slot,
                "model": current.ref.model_dump() if current else None,
                "probation": "ended",
            }
        self.wait_initial_load(slot)
        # Under the slot's lock: a swap in flight (a config reload serves first, records after)
        # has recorded its model before the rollback reads which model came before it.
        with self._slot_locks[slot]:
            return self._rollback(slot)

    def _rollback(self, slot: str) -> dict[str, Any]:
        saved = self.state.slot(slot)
        record = saved.last_known_good
        if record is None:
            raise NoRollbackTargetError(_why_no_rollback_target(slot, saved.active))
        if not Path(record.path).exists():
            raise NoRollbackTargetError(
                f"slot {slot!r} cannot roll back to {_named(record)}: its file {record.path} is gone"
            )
        current = self.slots[slot].current
        base = current.source if current is not None else model_source(self.slot_configs[slot])
        source = self.prepared(slot, _from_record(base, record), _build_of(record))
        try:
            loaded = self._activate(slot, source, "rollback", must_record=True)
        except OSError as exc:
            ref = current.ref if current is not None else None
            serving = (
                f"{ref.model_id} {ref.version or '(no version)'} keeps serving" if ref else "nothing changed"
            )
            raise DiskFullError(
                f"slot {slot!r} cannot roll back to {_named(record)}: state.json cannot be written "
                f"({exc}), and a rollback a restart would undo is no rollback; {serving}. Free space "
                "on the state disk and send it again"
            ) from exc
        log.warning("slot.rolled_back", slot=slot, model=record.model_id, version=record.version)
        return {"slot": slot, "model": loaded.ref.model_dump()}

    def _check_slot(self, slot: str) -> None:
        if slot not in self.slots:
            known = ", ".join(sorted(self.slots))
            raise NoSuchSlotError(f"no slot named {slot!r} on this device (slots: {known})")

    def snapshot(self) -> dict[str, Any]:
        """state.json as it is now (for the ``status`` command)."""
        with self._state_lock:
            return self.state.model_dump(mode="json")


def engine_report(effective: dict[str, Any]) -> EngineReport:
    """What one built engine effectively is, from its build's effective report (pure)."""
    device = str(effective.get("device", "cpu"))
    if device == "dla" and effective.get("dla_core") is not None:
        device = f"dla{effective['dla_core']}"
    placement = effective.get("placement") or {}
    requested = effective.get("engine_device") or (effective.get("requested") or {}).get("device")
    return EngineReport(
        device=device,
        precision=effective.get("precision"),
        dla_layers=placement.get("dla_layers"),
        gpu_layers=placement.get("gpu_layers"),
        requested=str(requested) if requested is not None else None,
    )


def engine_summary(effective: dict[str, Any]) -> dict[str, object]:
    """One engine of a set as job status lists it in ``effective.engines`` (pure)."""
    return {**engine_report(effective).as_dict(), "reason": effective.get("engine_reason")}


def engine_source(base: ModelSource, prepared: PreparedEngine) -> ModelSource:
    """``base`` (the slot's model) as one built engine: its file, backend, load options and report."""
    artifact = prepared.artifact
    return replace(
        base,
        path=artifact.engine_path,
        backend=artifact.backend,
        providers=tuple(artifact.providers),
        extra=tuple(artifact.load_extra.items()),
        engine_key=artifact.key,
        report=engine_report(prepared.effective),
        engines=(),
    )


def interim_source(candidate: ModelSource) -> ModelSource:
    """``candidate``'s ONNX model as it is, on ONNX Runtime with the best provider present: what a
    slot serves while its engine builds. Never ONNX Runtime's TensorRT provider, which would build
    a TensorRT engine of its own before serving its first frame."""
    return replace(
        candidate,
        backend="onnxruntime",
        providers=interim_providers(),
        extra=(),
        engine_key=None,
        build=None,
        report=None,
        engines=(),
    )


class _Handoff:
    """Between a start-up build and the start-up load: the build's outcome while the load still waits
    for it (a cache hit, an early failure), or the build keeps it once the load served the interim."""

    def __init__(self) -> None:
        self.building = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._outcome: ModelSource | BaseException | None = None
        self._taken = False

    def hand_over(self, outcome: ModelSource | BaseException) -> bool:
        """The build finished: True when the load takes ``outcome``, False when the build keeps it."""
        with self._lock:
            if self._taken:
                return False
            self._outcome = outcome
            self._done.set()
            self.building.set()
            return True

    def wait(self) -> ModelSource | BaseException | None:
        """The build's outcome if it finished before a build began, else None (serve the interim)."""
        self.building.wait()
        with self._lock:
            if self._done.is_set():
                return self._outcome
            self._taken = True
            return None


def _named(record: ModelRecord) -> str:
    return f"{record.model_id} {record.version or '(no version)'}"


def _why_no_rollback_target(slot: str, active: ModelRecord | None) -> str:
    if active is not None and active.origin == "rollback":
        return (
            f"slot {slot!r} was already rolled back to {_named(active)}; a rollback goes back one step, "
            "never forward: deploy a model (or change the config's) to move on"
        )
    return f"slot {slot!r} has no last-known-good model to roll back to (no earlier model ran in it)"


def _report_empty(slot: ModelSlot, problems: dict[Path, str]) -> None:
    """Say once, loudly, that a slot starts with no model, why, and what brings one."""
    slot.empty_reason = "; ".join(problems.values()) or "no model configured"
    log.warning(
        "agent.slot.empty",
        slot=slot.name,
        reason=slot.empty_reason,
        fix="put the model file in place and reload (systemctl reload edge-agent), or deploy a model "
        "to the slot; its streams publish no results until then",
    )


def _build_of(record: ModelRecord) -> BuildSpec | None:
    """The build request a recorded engine was made with (None: the ONNX model ran as it is)."""
    return BuildSpec.model_validate(record.build) if record.build else None


def _needs_frames(build: BuildSpec) -> bool:
    return build.calibration is not None and build.calibration.kind == "stream"


def _sha_or_none(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None


def _from_record(configured: ModelSource, record: ModelRecord) -> ModelSource:
    """The slot's configured source, pointed at a model recorded in state.json."""
    preprocess = PreprocessSpec.model_validate(record.preprocess) if record.preprocess else None
    postprocess = _POSTPROCESS.validate_python(record.postprocess) if record.postprocess else None
    return replace(
        configured,
        path=Path(record.path),
        model_id=record.model_id,
        version=record.version,
        backend="onnxruntime" if record.path.endswith(".onnx") else record.backend,
        preprocess=preprocess or configured.preprocess,
        postprocess=postprocess or configured.postprocess,
        sha256=None,
        model_path=None,
        share_engines=record.share_engines,
    )
