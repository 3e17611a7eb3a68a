"""Interim serving: a slot whose engine is not built yet serves its ONNX model meanwhile.

At start-up a slot whose engine is not in the cache serves its ONNX model on ONNX Runtime
(:func:`~agent.runtime.slots.models.sources.interim_source`) while the engine builds, then swaps to the
engine once built and validated; a slot whose build calibrates on live frames serves its ONNX model
until the streams run. ``up/info`` says ``serving: interim`` meanwhile.

One job (what a slot serves before its engine exists, and the swap to that engine), through the
slot's owner (:class:`~agent.runtime.slots.models.owner.SlotOwner`) and its lock.
"""

from __future__ import annotations

import threading
from typing import Literal

import structlog

from agent.engines.sharing.cache import ASKING_THE_FLEET
from agent.engines.sharing.startup import startup_job_id
from agent.errors import BuildError, EngineError
from agent.runtime.slots.loaded import LoadedModel, ModelSource
from agent.runtime.slots.models.owner import SlotOwner
from agent.runtime.slots.models.sources import Origin, interim_source
from agent.runtime.slots.models.startup_share import swap_guarded_and_offer
from agent.specs.build import BuildSpec

log = structlog.get_logger(__name__)


class InterimServing:
    """The interim model of each slot that serves one, and the swap to its engine."""

    def __init__(self, owner: SlotOwner) -> None:
        self._owner = owner
        #: The interim model (the ONNX model on ONNX Runtime) a slot serves while its engine builds.
        self._interim: dict[str, LoadedModel] = {}

    def serving(self, name: str) -> Literal["requested", "interim"] | None:
        """For up/info: ``interim`` while the slot serves its ONNX model as its engine builds."""
        current = self._owner.slots[name].current
        if current is None:
            return None
        return "interim" if current is self._interim.get(name) else "requested"

    def serve_until_streams_run(self, name: str, candidate: ModelSource, origin: Origin) -> None:
        """Calibration needs live frames: ``candidate``'s ONNX model serves (and is recorded, as
        the start-up load records) until its build can start (:meth:`build_and_swap`)."""
        self._interim[name] = self._owner.activate(name, candidate, origin=origin, must_record=False)
        log.warning(
            "slot.interim.serving",
            slot=name,
            model=candidate.model_id,
            why="its engine calibrates on live frames: it builds once the streams run, then swaps in",
        )

    def build_and_swap(self, name: str, candidate: ModelSource, build: BuildSpec, origin: Origin) -> None:
        """The build :meth:`serve_until_streams_run` deferred, run now (on the caller's thread), and
        the swap from the interim model to its engine, logged as any interim swap."""
        try:
            engine: ModelSource | BaseException = self._owner.prepared(name, candidate, build)
        except (EngineError, BuildError) as exc:
            engine = exc
        self._swap_from_interim(name, engine, origin)

    def serve_while_building(
        self, name: str, candidate: ModelSource, build: BuildSpec, origin: Origin
    ) -> None:
        """Activate ``candidate``'s engine if the cache has it, else serve the ONNX model on ONNX
        Runtime (:func:`interim_source`) and hot-swap to the engine once built and validated.

        Raises what :meth:`SlotOwner.prepared` raises when it fails before any build began (the
        caller tries the next candidate); a build that fails later leaves the interim model serving."""
        handoff = _Handoff()
        # A model from a sharing deployment: its build asks the fleet as a start-up job, and the engine
        # swaps in through shadow and probation and is offered (agent.runtime.slots.models.startup_share).
        job_id = startup_job_id(name) if candidate.share_engines else None

        def watch(message: str) -> None:
            # A local miss: the fleet is asked (a bounded wait, then a download) or a build starts.
            if message.startswith(("cache miss", ASKING_THE_FLEET)):
                handoff.building.set()

        def build_engine() -> None:
            try:
                engine: ModelSource | BaseException = self._owner.prepared(
                    name, candidate, build, watch=watch, job_id=job_id
                )
            except (EngineError, BuildError) as exc:
                engine = exc
            if handoff.hand_over(engine):
                return  # the caller waits for it: a cache hit, or a failure before any build
            self._swap_from_interim(name, engine, origin, job_id)

        self._owner.start_thread(build_engine, f"build-{name}")
        outcome = handoff.wait()
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            self._owner.activate(name, outcome, origin=origin, must_record=False)
            return
        interim = interim_source(candidate, build)
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
        with self._owner.lock(name):
            self._interim[name] = self._owner.slots[name].load(source, self._owner.latest_frame(name))
        self._owner.on_activated()

    def _swap_from_interim(
        self, name: str, engine: ModelSource | BaseException, origin: Origin, job_id: str | None = None
    ) -> None:
        """The engine built while the interim model served: swapped in, if the slot still serves that
        (through shadow and probation, then offered, for a start-up job of a sharing model)."""
        if isinstance(engine, BaseException):
            log.error("slot.interim.build_failed", slot=name, error=str(engine), serving="interim")
            self._owner.metrics.counter(f"slot.{name}.swap_failures").inc()
            return
        with self._owner.lock(name):
            interim = self._interim.get(name)
            current = self._owner.slots[name].current
            if current is not None and current is not interim:
                # A deployment or rollback activated since: its model wins, the built engine stays cached.
                log.warning("slot.interim.superseded", slot=name, serving=current.ref.model_id)
                fleet = self._owner.engines.builder.fleet
                if fleet is not None and engine.engine_key is not None:
                    fleet.release(engine.engine_key, "superseded before its start-up swap: never offered")
                return
            if job_id is not None and interim is not None and current is interim:
                if not swap_guarded_and_offer(self._owner, name, engine, origin, job_id):
                    self._owner.metrics.counter(f"slot.{name}.swap_failures").inc()
                    return
                self._interim.pop(name, None)
                log.info("slot.interim.swapped", slot=name, model=engine.model_id, backend=engine.backend)
                return
            try:
                self._owner.activate_locked(name, engine, origin, must_record=False)
            except EngineError as exc:
                log.error("slot.interim.swap_rejected", slot=name, error=str(exc), serving="interim")
                self._owner.metrics.counter(f"slot.{name}.swap_failures").inc()
                return
            self._interim.pop(name, None)  # closed: nothing may hold on to it
        log.info("slot.interim.swapped", slot=name, model=engine.model_id, backend=engine.backend)


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
