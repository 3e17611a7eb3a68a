"""The one owner of every slot's model: each slot's lock, its start-up gate, and the activation
that loads a model and records it in state.json.

One job (a slot changes model only under its one lock, and state.json records every activation
the same way before anyone is told), shared by the parts of
:class:`~agent.runtime.slots.models.choice.SlotModels` that decide which model to activate: the
start-up choice and reloads (:mod:`agent.runtime.slots.models.choice`), interim serving
(:mod:`agent.runtime.slots.models.interim`: the one load it never records), deployments
(:mod:`agent.runtime.slots.models.deployments`: a guarded one records through
:meth:`SlotOwner.record` when it commits) and rollbacks (:mod:`agent.runtime.slots.models.rollback`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.config import SlotConfig
from agent.delivery.commands import NoSuchSlotError
from agent.engines.service import EngineService
from agent.engines.sharing.cache import FleetEngineCache
from agent.errors import EngineError
from agent.fsutil import sha256_file
from agent.runtime.slots.loaded import LoadedModel, ModelSource
from agent.runtime.slots.models.builds import SlotBuilds
from agent.runtime.slots.models.sources import Origin, engine_source, record_of
from agent.runtime.slots.slot import ModelSlot
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.state.file import StateFile, record_activation, record_config_model, record_rollback
from agent.store import ModelStore
from agent.telemetry import Metrics

log = structlog.get_logger(__name__)

#: How long a deployment or rollback waits for the slot's start-up load (which may build an engine).
INITIAL_LOAD_WAIT_S = 600.0


class SlotOwner:
    """Every slot's lock, and the one place a model is loaded into a slot and recorded."""

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
    ) -> None:
        self.slots = slots
        self.slot_configs = slot_configs
        self.state_file = state_file
        self.state = state_file.load()
        self.engines = engines
        self.metrics = metrics
        self.latest_frame = latest_frame
        self.on_activated = on_activated
        self._state_lock = threading.Lock()
        self._swap_threads: list[threading.Thread] = []
        # One owner per slot: a slot's activations (load + state.json record) never interleave, and
        # nothing but the start-up load touches a slot before that load is over. A deployment resumed
        # at start-up (its retained manifest arrives while the first model loads) would otherwise
        # activate and then be overwritten by the start-up load, or race it for state.json.
        self._slot_locks = {name: threading.Lock() for name in slots}
        self._initial_done = {name: threading.Event() for name in slots}
        #: Builds a slot started itself (start-up, reload), for up/info; progress republishes it.
        self.builds = SlotBuilds(on_activated)

    def lock(self, name: str) -> threading.Lock:
        """Slot ``name``'s one owner lock: held by whatever loads a model into it and records it."""
        return self._slot_locks[name]

    def check_slot(self, slot: str) -> None:
        """NoSuchSlotError (naming the slots there are) for a slot this device does not have."""
        if slot not in self.slots:
            known = ", ".join(sorted(self.slots))
            raise NoSuchSlotError(f"no slot named {slot!r} on this device (slots: {known})")

    # -- the start-up gate ---------------------------------------------------------------------

    def initial_load_done(self, name: str) -> None:
        """The start-up load of slot ``name`` is over (served or not): others may change the slot."""
        self._initial_done[name].set()

    def wait_initial_load(self, name: str, timeout: float = INITIAL_LOAD_WAIT_S) -> None:
        """Block until the start-up load of slot ``name`` is over (EngineError after ``timeout``)."""
        if not self._initial_done[name].wait(timeout):
            raise EngineError(
                f"slot {name}: its start-up model load is still running after {timeout:.0f} s; "
                "the deployment waits for no longer: publish it again once the slot serves"
            )

    # -- activations -----------------------------------------------------------------------------

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
            return self.activate_locked(name, source, origin, must_record)

    def activate_locked(
        self, name: str, source: ModelSource, origin: Origin, must_record: bool
    ) -> LoadedModel:
        """:meth:`activate` for a caller that holds the slot's :meth:`lock` already."""
        sample = self.latest_frame(name)
        slot = self.slots[name]
        if must_record:
            loaded = slot.load(source, sample, before_swap=lambda c: self.record(name, source, c, origin))
        else:
            loaded = slot.load(source, sample)
            try:
                self.record(name, source, loaded, origin)
            except OSError as exc:
                log.error("agent.state.not_recorded", slot=name, model=loaded.ref.model_id, error=str(exc))
        self.activated()
        return loaded

    def activated(self) -> None:
        """A model serves for good: its engines are protected, and whoever publishes up/info is told."""
        self.protect_engines()
        self.on_activated()

    def record(self, name: str, source: ModelSource, loaded: LoadedModel, origin: Origin) -> None:
        """Record ``loaded`` as the slot's active model in state.json (its predecessor becomes the
        last-known-good); OSError when the disk refuses it (nothing changes then)."""
        record = record_of(source, loaded, origin)
        # A rollback leaves no rollback target behind: a second one must not swap forward. (A restart
        # that restores a rolled-back model finds no target already, so the same rule holds there.)
        record_change = record_rollback if origin == "rollback" else record_activation
        with self._state_lock:
            changed = record_change(self.state, name, record)
            # Kept in memory only once on disk: what a restart brings back is what this process says.
            self.state_file.save(changed)
            self.state = changed

    def record_config(self, name: str, config_sha: str | None) -> None:
        """Remember which model file the config names for slot ``name`` (best effort: logged when
        the disk refuses it)."""
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

    # -- engines -------------------------------------------------------------------------------

    def prepared(
        self,
        name: str,
        source: ModelSource,
        build: BuildSpec | None,
        *,
        watch: Callable[[str], None] | None = None,
        job_id: str | None = None,
    ) -> ModelSource:
        """``source`` as the engine its build request asks for (built, or found in the cache).

        Its progress goes to up/info (``building``) while it runs; ``watch`` sees every line too.
        ``job_id``: the start-up job the fleet hears of when the model shares engines."""
        if build is None:
            return source
        with self.builds.building(name, source.model_id, source.version) as published:

            def progress(message: str) -> None:
                log.info("engine.build.progress", slot=name, message=message)
                published(message)
                if watch is not None:
                    watch(message)

            with FleetEngineCache.sharing(source.share_engines, job_id, source.model_id, source.version):
                engines = self.engines.prepare_set(
                    name, source.path, build, source.preprocess, progress=progress
                )
        fleet = self.engines.builder.fleet
        for prepared in engines:
            artifact = prepared.artifact
            if job_id is None and fleet is not None:
                # Nothing offers what this build made (no shadow, no probation): the fleet's next asker
                # builds it rather than waiting for this device.
                fleet.release(artifact.key, "built outside a guarded job: never offered")
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
        """The sha256 of every active or last-known-good model, and of the calibration artifact each
        was built with (the model and artifact stores keep them: a rollback may rebuild from it)."""
        with self._state_lock:
            records = [r for s in self.state.slots.values() for r in (s.active, s.last_known_good) if r]
        protected = {r.sha256 for r in records}
        for record in records:
            calibration = (record.build or {}).get("calibration") or {}
            sha = ModelStore.sha_named(calibration["path"]) if calibration.get("path") else None
            if sha is not None:
                protected.add(sha)
        return protected

    # -- threads -------------------------------------------------------------------------------

    def start_thread(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` (a swap or a build) in the background; :meth:`join_swaps` waits for it."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._swap_threads.append(thread)
        thread.start()

    def join_swaps(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for swaps in progress (at shutdown)."""
        deadline = time.monotonic() + timeout
        for thread in self._swap_threads:
            thread.join(max(0.1, deadline - time.monotonic()))

    # -- reading -------------------------------------------------------------------------------

    def slot_specs(self, slot: str) -> tuple[PreprocessSpec, PostprocessSpec] | None:
        """The pre- and postprocessing slot ``slot`` runs now (its config's when it is empty)."""
        if slot not in self.slots:
            return None
        current = self.slots[slot].current
        if current is not None:
            return current.source.preprocess, current.source.postprocess  # type: ignore[return-value]
        slot_config = self.slot_configs[slot]
        return slot_config.preprocess, slot_config.postprocess

    def snapshot(self) -> dict[str, Any]:
        """state.json as it is now (for the ``status`` command)."""
        with self._state_lock:
            return self.state.model_dump(mode="json")
