"""What a slot runs at start and after a config reload, and :class:`SlotModels`, the one object the
composition root wires for the slots' models.

The start-up choice is what the slot ran before the restart, else the config's model, else a
fallback; a config reload hot-swaps. :class:`SlotModels` also hands on to the other parts of this
package (interim serving, deployments, rollback), all through the slots' one owner
(:class:`~agent.runtime.slots.models.owner.SlotOwner`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog

from agent.config import SlotConfig
from agent.delivery.commands import Followed
from agent.delivery.jobs.steps import ActivationRequest, BuildOutcome, JobReporter
from agent.engines.service import EngineService
from agent.errors import AgentError, BuildError, EngineError
from agent.protocol.command_args import CalibrateArgs
from agent.runtime.slots.evidence import EvidenceStore
from agent.runtime.slots.loaded import LoadedModel, ModelSource
from agent.runtime.slots.models.deployments import SlotDeployments
from agent.runtime.slots.models.interim import InterimServing
from agent.runtime.slots.models.owner import SlotOwner
from agent.runtime.slots.models.rollback import SlotRollback
from agent.runtime.slots.models.sources import (
    Origin,
    build_of,
    from_record,
    model_source,
    needs_frames,
    sha_or_none,
)
from agent.runtime.slots.slot import ModelSlot
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.state.file import AgentState, StateFile
from agent.telemetry import Metrics

log = structlog.get_logger(__name__)


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
        self.state_file = state_file
        self.owner = SlotOwner(
            slots,
            slot_configs,
            state_file,
            engines,
            metrics,
            latest_frame=latest_frame,
            on_activated=on_activated,
        )
        #: Builds a slot started itself (start-up, reload), for up/info; progress republishes it.
        self.builds = self.owner.builds
        self.interim = InterimServing(self.owner)
        self.deployments = SlotDeployments(self.owner, evidence)
        self.rollbacks = SlotRollback(self.owner, self.deployments.guard_runs)
        self._configured: dict[str, tuple[ModelSource, BuildSpec | None, str | None]] = {}
        self._deferred_builds: list[tuple[str, ModelSource, BuildSpec, Origin]] = []
        metrics.add_collector(self.deployments.guard_stats, prefix="slot.")
        self.owner.protect_engines()

    @property
    def state(self) -> AgentState:
        """state.json as this process last recorded it."""
        return self.owner.state

    @property
    def engines(self) -> EngineService:
        """The engine service the slots build and load their engines with."""
        return self.owner.engines

    # -- start-up and reloads ------------------------------------------------------------------

    def load_initial(self, name: str, slot_config: SlotConfig) -> None:
        """Come back on what the slot ran before the restart, else the config's model, else a fallback.

        A delivered (or rolled-back-to) model outlives restarts until the operator changes the model
        file the config names; then the config wins. Deployments and rollbacks of the slot wait for it.
        """
        try:
            self._load_initial(name, slot_config)
        finally:
            self.owner.initial_load_done(name)

    def _load_initial(self, name: str, slot_config: SlotConfig) -> None:
        owner = self.owner
        configured = model_source(slot_config)
        config_sha = sha_or_none(configured.path)
        saved = owner.state.slot(name)
        # (source, build request, origin), in order of preference.
        candidates: list[tuple[ModelSource, BuildSpec | None, Origin]] = []
        if saved.active is not None and saved.active.origin != "config" and saved.config_sha256 == config_sha:
            candidates.append(
                (from_record(configured, saved.active), build_of(saved.active), saved.active.origin)
            )
        candidates.append((configured, slot_config.build, "config"))
        candidates.extend(
            (from_record(configured, record), build_of(record), record.origin)
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
                if build is not None and needs_frames(build):
                    # Calibration needs live frames: serve the ONNX model first, build once streams run.
                    self.interim.serve_until_streams_run(name, candidate, origin)
                    self._deferred_builds.append((name, candidate, build, origin))
                elif build is not None and owner.engines.config.serve_while_building:
                    # Serve at once: the engine comes from the cache, or builds while the ONNX model serves.
                    self.interim.serve_while_building(name, candidate, build, origin)
                else:
                    # A built engine comes back from the engine cache (rebuilt only if it was evicted).
                    source = owner.prepared(name, candidate, build)
                    owner.activate(name, source, origin=origin, must_record=False)
                if origin != "config" or candidate.path != configured.path:
                    log.warning("agent.slot.restored", slot=name, model=source.model_id, ver=source.version)
                break
            except (EngineError, BuildError) as exc:
                log.error("agent.slot.initial_failed", slot=name, model=str(source.path), error=str(exc))
                problems[candidate.path] = f"model {candidate.path} failed to load: {exc}"
        if self.slots[name].current is None:
            _report_empty(self.slots[name], problems)
        owner.record_config(name, config_sha)

    def start_deferred_builds(self) -> None:
        """Builds that need live frames (stream calibration) start once the streams run."""
        for name, source, build, origin in self._deferred_builds:
            self.owner.start_thread(
                partial(self.interim.build_and_swap, name, source, build, origin), f"swap-{name}"
            )
        self._deferred_builds.clear()

    def reload(self, slot_configs: dict[str, SlotConfig]) -> list[str]:
        """Hot-swap every slot whose configured model, file or build request changed (or that is
        empty); return their names. The swaps run in the background and log their outcome."""
        swapping = []
        for name, slot_config in slot_configs.items():
            if name not in self.slots:
                continue
            source = model_source(slot_config)
            wanted = (source, slot_config.build, sha_or_none(source.path))
            if self._configured.get(name) == wanted and self.slots[name].current is not None:
                continue
            self._configured[name] = wanted
            self.start_swap(name, source, slot_config.build)
            swapping.append(name)
        self.owner.slot_configs = {
            **self.owner.slot_configs,
            **{k: v for k, v in slot_configs.items() if k in self.slots},
        }
        return swapping

    def start_swap(self, name: str, source: ModelSource, build: BuildSpec | None) -> None:
        """Build (when asked) and hot-swap ``source`` into slot ``name`` in the background."""
        self.owner.start_thread(partial(self._swap, name, source, build), f"swap-{name}")

    def _swap(self, name: str, source: ModelSource, build: BuildSpec | None = None) -> None:
        try:
            if self._serves_while_building(name, source, build):
                return
            self.owner.activate(name, self.owner.prepared(name, source, build), must_record=False)
        except (EngineError, BuildError) as exc:
            log.error("slot.swap.rejected", slot=name, error=str(exc))
            self.owner.metrics.counter(f"slot.{name}.swap_failures").inc()

    def _serves_while_building(self, name: str, source: ModelSource, build: BuildSpec | None) -> bool:
        """An empty slot given a model to build (a config reload) serves its ONNX model meanwhile, as
        at start-up; True when the interim took over the whole swap. A slot that serves keeps serving
        its current model through the build instead (the swap replaces it once built)."""
        if build is None or self.slots[name].current is not None:
            return False
        if needs_frames(build):
            # Calibration needs live frames: the ONNX model serves while they are gathered.
            self.interim.serve_until_streams_run(name, source, "config")
            self.interim.build_and_swap(name, source, build, "config")
            return True
        if not self.owner.engines.config.serve_while_building:
            return False
        self.interim.serve_while_building(name, source, build, "config")
        return True

    def join_swaps(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for swaps in progress (at shutdown)."""
        self.owner.join_swaps(timeout)

    # -- what the composition root wires ---------------------------------------------------------

    def activate(
        self, name: str, source: ModelSource, *, origin: Origin = "config", must_record: bool = True
    ) -> LoadedModel:
        """Load ``source`` into slot ``name`` and record it (:meth:`SlotOwner.activate`)."""
        return self.owner.activate(name, source, origin=origin, must_record=must_record)

    def serving(self, name: str) -> Literal["requested", "interim"] | None:
        """For up/info: ``interim`` while the slot serves its ONNX model as its engine builds."""
        return self.interim.serving(name)

    def build_delivered(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        """A deployment's BUILDING step (:meth:`SlotDeployments.build_delivered`)."""
        return self.deployments.build_delivered(model, spec, reporter)

    def activate_delivered(self, request: ActivationRequest) -> None:
        """A deployment's engine into its slot (:meth:`SlotDeployments.activate_delivered`)."""
        self.deployments.activate_delivered(request)

    def rollback(self, slot: str) -> dict[str, Any] | Followed:
        """``rollback`` command (:meth:`SlotRollback.rollback`)."""
        return self.rollbacks.rollback(slot)

    def calibrate(self, args: CalibrateArgs) -> dict[str, Any]:
        """``calibrate`` command: ``{"slot": S, "frames": N}`` from the slot's live streams."""
        slot, frames = args.slot, args.frames
        self.owner.check_slot(slot)
        current = self.slots[slot].current
        if current is None:
            raise AgentError(f"slot {slot!r} has no active model to calibrate")
        model = current.source.model_path or current.source.path
        return self.owner.engines.calibrate(slot, model, current.source.preprocess, frames)

    def slot_specs(self, slot: str) -> tuple[PreprocessSpec, PostprocessSpec] | None:
        """The pre- and postprocessing slot ``slot`` runs now (its config's when it is empty)."""
        return self.owner.slot_specs(slot)

    def protected_models(self) -> set[str]:
        """The sha256 of every active or last-known-good model (the model store keeps them)."""
        return self.owner.protected_models()

    def snapshot(self) -> dict[str, Any]:
        """state.json as it is now (for the ``status`` command)."""
        return self.owner.snapshot()


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
