"""The simulated model loop: a slot that "loads" at once and reports the figures the scenario dictates.

A stand-in for :class:`agent.runtime.slots.models.choice.SlotModels` behind the delivery service's seam (the
``activate``, ``rollback``, ``slot_specs`` and ``protected_models`` callables that
:mod:`agent.app.root` wires to the real runtime). No engine is built and no frame runs: a delivered
model becomes the slot's model at once, after the guard phases the manifest asks for, which behave
as the real ones (:mod:`agent.runtime.slots.guarded`) end:

* ``shadow``: SHADOW is entered, figures are reported (agreement 0.97, latency ratio 1.05, or the
  device's unhealthy figure: agreement 0.5, latency ratio 3.0) and judged against the manifest's
  bar; below it the job ends REJECTED (``shadow_disagrees``/``too_slow``) and the old model serves;
* ``probation_s`` > 0 (and a model served before): PROBATION is entered, lasting ``probation_s``
  (cut short by the job's cancel event); an unhealthy device crosses its figure's bar (NaN outputs
  and inference errors after a second, ratios at the end) and the job ends ROLLED_BACK (``unhealthy``)
  with the figures, the previous model serving again;
* ``load``: the model fails to load (an :class:`~agent.errors.EngineError`): ROLLED_BACK.

The slots' models live in memory (the simulator's equivalent of ``state.json``): they survive a
simulated device restart inside one simulator process, not the process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from agent.delivery.jobs.steps import ActivationRequest, GuardReporter
from agent.errors import EngineError
from agent.fleetsim.plan import Figure
from agent.protocol.delivery_errors import JobCancelledError, RolledBackError, ShadowRejectedError
from agent.protocol.messages import FailedFigure, JobState, ModelRef, ProbationFigures, ShadowFigures
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

#: How often a probation reports its figures (the real one: every 5 s).
_REPORT_EVERY_S = 5.0
#: When an immediate failure (NaN outputs, inference errors) shows in a probation.
_FAST_FAILURE_S = 1.0
_HEALTHY_CURRENT = {"fps_ratio.cam0": 0.99, "p99_ratio": 1.1, "nan_outputs": 0.0, "infer_errors": 0.0}
_BASELINE = {"fps.cam0": 29.8, "p99_ms": 11.0, "nan_outputs": 0.0, "infer_errors": 0.0}


@dataclass
class _Slot:
    model: ModelRef | None
    previous: ModelRef | None
    since: float


class SimSlots:
    """Every slot of one simulated device: what it serves, and the stand-in activation."""

    def __init__(
        self,
        initial: dict[str, ModelRef | None],
        specs: dict[str, tuple[PreprocessSpec, PostprocessSpec]],
        unhealthy: Figure | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._slots = {name: _Slot(ref, None, time.time()) for name, ref in initial.items()}
        self._specs = specs
        self.unhealthy = unhealthy
        #: Called after a slot's model changed (the device republishes ``up/info``).
        self.on_change: Any = None

    # -- what the rest of the device reads -------------------------------------------------------

    def current(self, slot: str) -> tuple[ModelRef | None, float]:
        """The model ``slot`` serves (None: empty) and since when."""
        with self._lock:
            s = self._slots[slot]
            return s.model, s.since

    def names(self) -> list[str]:
        return list(self._slots)

    def slot_specs(self, slot: str) -> tuple[PreprocessSpec, PostprocessSpec] | None:
        """The delivery service's ``slot_specs``: the slot's pre/postprocessing; None: no such slot."""
        return self._specs.get(slot)

    def protected_models(self) -> set[str]:
        """SHA-256s the store's gc must keep: every slot's model and previous model."""
        with self._lock:
            refs = [r for s in self._slots.values() for r in (s.model, s.previous) if r is not None]
        return {r.sha256 for r in refs}

    def describe(self) -> dict[str, Any]:
        """Per slot, the model served and the previous one (the ``status`` command's ``slots``)."""
        with self._lock:
            return {
                name: {
                    "state": "active" if s.model else "empty",
                    "model": s.model.model_dump() if s.model else None,
                    "previous": s.previous.model_dump() if s.previous else None,
                }
                for name, s in self._slots.items()
            }

    # -- the seam: what the delivery service calls -----------------------------------------------

    def rollback(self, slot: str) -> dict[str, Any]:
        """The ``rollback`` command: the previous model serves again."""
        with self._lock:
            s = self._slots.get(slot)
            if s is None or s.previous is None:
                raise EngineError(f"slot {slot!r} has no previous model to roll back to")
            s.model, s.previous, s.since = s.previous, s.model, time.time()
            model = s.model
        self._changed()
        return {"slot": slot, "model": model.model_dump() if model else None}

    def activate(self, request: ActivationRequest) -> None:
        """The delivery service's ``activate``: the guard phases the manifest asks for, then the swap."""
        if self.unhealthy == "load":
            raise EngineError(f"simulated: model {request.model_id} {request.version} failed to load")
        ref = ModelRef(
            slot=request.slot, model_id=request.model_id, version=request.version, sha256=request.sha256
        )
        guard = request.guard
        if request.shadow is not None and guard is not None:
            self._shadow(request, guard)
        with self._lock:
            s = self._slots[request.slot]
            previous = s.model
            s.model, s.since = ref, time.time()
        self._changed()
        if previous is not None and request.probation_s > 0 and guard is not None:
            try:
                self._probation(request, guard)
            except BaseException:
                with self._lock:
                    s.model, s.since = previous, time.time()
                self._changed()
                raise
        with self._lock:
            s.previous = previous

    # -- the guard phases ------------------------------------------------------------------------

    def _shadow(self, request: ActivationRequest, guard: GuardReporter) -> None:
        spec = request.shadow
        assert spec is not None
        guard.enter(JobState.SHADOW)
        figures = ShadowFigures(
            frames=spec.frames,
            agreement=0.5 if self.unhealthy == "agreement" else 0.97,
            latency_ratio=3.0 if self.unhealthy == "latency_ratio" else 1.05,
            top5_overlap=0.6 if self.unhealthy == "agreement" else 0.95,
            bad_outputs=0,
        )
        guard.figures(shadow=figures)
        assert figures.agreement is not None
        assert figures.latency_ratio is not None
        if spec.min_agreement is not None and figures.agreement < spec.min_agreement:
            raise ShadowRejectedError(
                f"shadow on {figures.frames} live frames: agreement {figures.agreement} is below "
                f"min_agreement {spec.min_agreement}; the previous model never stopped serving",
                code="shadow_disagrees",
            )
        if figures.latency_ratio > spec.max_latency_ratio:
            raise ShadowRejectedError(
                f"shadow on {figures.frames} live frames: latency ratio {figures.latency_ratio} is above "
                f"max_latency_ratio {spec.max_latency_ratio}; the previous model never stopped serving",
                code="too_slow",
            )

    def _probation(self, request: ActivationRequest, guard: GuardReporter) -> None:
        bars = request.probation
        started = time.monotonic()
        guard.enter(JobState.PROBATION)
        failing: FailedFigure | None = None
        fails_at = request.probation_s
        if self.unhealthy == "nan_outputs":
            failing = FailedFigure(figure="nan_outputs", value=3.0, bar=float(bars.max_nan_outputs))
            fails_at = min(fails_at, _FAST_FAILURE_S)
        elif self.unhealthy == "infer_errors":
            failing = FailedFigure(figure="infer_errors", value=2.0, bar=float(bars.max_infer_errors))
            fails_at = min(fails_at, _FAST_FAILURE_S)
        elif self.unhealthy == "fps_ratio":
            failing = FailedFigure(figure="fps_ratio.cam0", value=0.4, bar=bars.min_fps_ratio)
        elif self.unhealthy == "p99_ratio":
            failing = FailedFigure(figure="p99_ratio", value=bars.max_p99_ratio * 2, bar=bars.max_p99_ratio)
        last_report = started
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= fails_at:
                break
            if guard.cancel.wait(min(0.5, fails_at - elapsed)):
                raise JobCancelledError(
                    f"slot {request.slot}: probation ended (job cancelled); the previous model serves"
                )
            if time.monotonic() - last_report >= _REPORT_EVERY_S:
                last_report = time.monotonic()
                guard.figures(probation=self._figures(request.probation_s, started, None))
        figures = self._figures(request.probation_s, started, failing)
        guard.figures(probation=figures)
        if failing is not None:
            raise RolledBackError(
                f"new model unhealthy in probation ({failing.figure} = {failing.value:g}, bar "
                f"{failing.bar:g}); slot {request.slot} swapped back to the previous model, which keeps "
                "serving"
            )

    def _figures(self, probation_s: float, started: float, failed: FailedFigure | None) -> ProbationFigures:
        current = dict(_HEALTHY_CURRENT)
        if failed is not None:
            current[failed.figure] = failed.value
        return ProbationFigures(
            elapsed_s=round(time.monotonic() - started, 3),
            probation_s=probation_s,
            baseline=dict(_BASELINE),
            current=current,
            failed=failed,
        )

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
