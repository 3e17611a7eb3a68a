"""A guarded activation: validate, shadow, swap, probation, then commit or swap back.

The row of steps (docs/protocol.md, "Shadow and probation"), run by the deployment's worker thread
while it owns the slot:

1. load and validate the candidate beside the serving model (:meth:`ModelSlot.load_candidate`);
2. SHADOW (when the manifest asks): compare both on sampled live frames
   (:func:`~agent.runtime.slots.shadow.run_shadow`); below the bar the candidate is dropped, never having
   served, and the job ends REJECTED with the figures;
3. swap it in, keeping the previous model loaded;
4. PROBATION (when ``probation_s`` > 0): watch its health against the previous model's baseline,
   and its latency against the previous model's timed on the same frames at the same moments
   (:func:`~agent.runtime.slots.probation.run_probation`); unhealthy, an operator rollback, a newer job or
   the agent stopping swap the previous model back in (a reference swap: no frame is lost) and the
   rejected model's last result is published before the job's end is;
5. commit: only now is the new model recorded in state.json as active (its predecessor becoming the
   last-known-good). A restart before this comes back on the previous model, and so does this
   process when the record fails (a full state disk): the previous model is swapped back in and the
   job ends on the error (``FAILED disk_full``), so what serves, what ``up/info`` and the job say
   and what a restart brings back agree. Without probation the record comes before the swap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import structlog

from agent.delivery.jobs.steps import ActivationRequest, GuardReporter
from agent.protocol.delivery_errors import JobCancelledError, RolledBackError, ShadowRejectedError
from agent.protocol.messages import JobState, ShadowFigures
from agent.runtime.slots.agreement import ShadowTally, frame_agreement
from agent.runtime.slots.evidence import EvidenceStore
from agent.runtime.slots.loaded import LoadedModel, ModelSource
from agent.runtime.slots.probation import ProbationRun, run_probation
from agent.runtime.slots.shadow import predict, run_shadow
from agent.runtime.slots.slot import ModelSlot

log = structlog.get_logger(__name__)

#: How long the end of a probation waits for the rejected model's in-flight batches and results.
_DRAIN_S = 10.0


@dataclass
class ShadowRun:
    """One slot's shadow run in progress (what telemetry shows of it)."""

    slot: str
    tally: ShadowTally | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def telemetry(self) -> dict[str, float]:
        out = {"shadow.active": 1.0}
        if self.tally is not None:
            out.update({f"shadow.{k}": float(v) for k, v in self.tally.figures().items() if v is not None})
        return out


GuardRun: TypeAlias = ShadowRun | ProbationRun


@dataclass(frozen=True)
class GuardedSlot:
    """What a guarded activation needs of its slot and of the slot's owner
    (:class:`~agent.runtime.slots.models.owner.SlotOwner`)."""

    slot: ModelSlot
    latest_frame: Callable[[], npt.NDArray[np.uint8] | None]
    #: Record the model as the slot's active one in state.json (the commit); raises when it cannot.
    record: Callable[[ModelSource, LoadedModel], None]
    #: Tell whoever publishes up/info, once the committed model serves for good.
    activated: Callable[[], None]
    #: Where the runs are published for telemetry and the rollback command.
    runs: dict[str, GuardRun]
    #: Where a rejection's disagreement frames are kept (None: not kept).
    evidence: EvidenceStore | None = None


def activate_guarded(target: GuardedSlot, request: ActivationRequest, source: ModelSource) -> None:
    """Run the guarded activation of ``request`` (``source`` resolved); raises like the ActivateFn."""
    guard = request.guard
    assert guard is not None
    slot = target.slot
    candidate = slot.load_candidate(source, target.latest_frame())
    if request.shadow is not None:
        _shadow(target, request, candidate, guard)
    if slot.current is None or request.probation_s <= 0:
        # Nothing to watch it against: recorded first, then swapped in, so a disk that refuses the
        # record leaves the previous model serving, as state.json says.
        try:
            target.record(source, candidate)
        except BaseException:
            slot.discard(candidate)
            raise
        previous = slot.swap_in(candidate)
        if previous is not None:
            previous.retire()
        target.activated()
        return
    swap_at = time.monotonic()
    previous = slot.swap_in(candidate)
    assert previous is not None  # the slot served a model (checked above, under its owner lock)
    baseline = previous.health.figures(swap_at - request.probation.baseline_s, swap_at)
    run = ProbationRun(slot.name, request.probation_s, swap_at, baseline)
    target.runs[slot.name] = run
    try:
        guard.enter(JobState.PROBATION)
        outcome = run_probation(
            run,
            candidate,
            request.probation,
            guard.cancel,
            report=lambda f: guard.figures(probation=f),
            latest_frame=target.latest_frame,
            previous=previous,
        )
    except BaseException:
        slot.swap_back(previous, candidate)
        run.done.set()
        raise
    if outcome == "healthy":
        try:
            target.record(source, candidate)
        except BaseException as exc:
            # State disk full: state.json still names the previous model, so that one serves again
            # (what a restart would bring back) and the job ends on this error (FAILED disk_full).
            log.error("probation.commit_failed", slot=slot.name, error=str(exc), serving="previous model")
            slot.swap_back(previous, candidate)
            candidate.wait_idle(_DRAIN_S)
            run.done.set()
            raise
        previous.retire()
        run.done.set()
        guard.figures(probation=run.figures)
        target.activated()
        return
    keep_evidence = outcome == "unhealthy" and target.evidence is not None
    if keep_evidence:
        candidate.acquire()  # its runner stays open past the swap back, for the evidence frames
    slot.swap_back(previous, candidate)
    if keep_evidence:
        try:
            _probation_evidence(target, guard, candidate, run)
        finally:
            candidate.release()
    if outcome != "cancelled" and not candidate.wait_idle(_DRAIN_S):
        log.warning("probation.drain_timeout", slot=slot.name, model=candidate.ref.model_id)
    run.done.set()
    if outcome == "cancelled":
        raise JobCancelledError(
            f"slot {slot.name}: probation ended (job cancelled); the previous model serves"
        )
    guard.figures(probation=run.figures)
    old = f"{previous.ref.model_id} {previous.ref.version or ''}".strip()
    if outcome == "operator_rollback":
        raise RolledBackError(
            f"rollback command during probation: slot {slot.name} swapped back to {old}",
            code="operator_rollback",
        )
    failed = run.figures.failed if run.figures is not None else None
    what = f"{failed.figure} = {failed.value:g}, bar {failed.bar:g}" if failed is not None else "unhealthy"
    raise RolledBackError(
        f"new model unhealthy in probation ({what}); slot {slot.name} swapped back to {old}, "
        "which keeps serving"
    )


def _shadow(
    target: GuardedSlot, request: ActivationRequest, candidate: LoadedModel, guard: GuardReporter
) -> None:
    assert request.shadow is not None
    slot = target.slot
    run = ShadowRun(slot.name)
    target.runs[slot.name] = run
    heap = target.evidence.heap() if target.evidence is not None else None
    try:
        guard.enter(JobState.SHADOW)

        def report(tally: ShadowTally) -> None:
            run.tally = tally
            guard.figures(shadow=ShadowFigures.model_validate(tally.figures()))

        tally, verdict = run_shadow(
            slot,
            candidate,
            request.shadow,
            latest_frame=target.latest_frame,
            cancel=guard.cancel,
            report=report,
            evidence=heap,
        )
    except BaseException:
        slot.discard(candidate)
        run.done.set()
        raise
    run.tally = tally
    run.done.set()
    figures = ShadowFigures.model_validate(tally.figures())
    guard.figures(shadow=figures)
    if verdict == "pass":
        return
    if target.evidence is not None and heap is not None and len(heap):
        serving = slot.current
        serving_model = _model_name(serving) if serving is not None else ""
        guard.evidence(
            target.evidence.keep(
                guard.job_id,
                slot=slot.name,
                reason=verdict or "shadow_no_frames",
                serving_model=serving_model,
                candidate_model=_model_name(candidate),
                heap=heap,
            )
        )
    slot.discard(candidate)
    spec = request.shadow
    why = {
        "shadow_disagrees": f"agreement {figures.agreement} is below min_agreement {spec.min_agreement}",
        "too_slow": f"latency ratio {figures.latency_ratio} is above max_latency_ratio "
        f"{spec.max_latency_ratio}",
        "bad_output": f"NaN or infinite outputs on {figures.bad_outputs} live frames",
        None: f"no live frame to compare within timeout_s {spec.timeout_s:g} (is the camera running?)",
    }[verdict]
    raise ShadowRejectedError(
        f"shadow on {figures.frames} live frames: {why}; the previous model never stopped serving",
        code=verdict or "shadow_no_frames",
    )


def _model_name(model: LoadedModel) -> str:
    return f"{model.ref.model_id} {model.ref.version or ''}".strip()


def _probation_evidence(
    target: GuardedSlot, guard: GuardReporter, rejected: LoadedModel, run: ProbationRun
) -> None:
    """Both models on the probation's last live frames (the previous one serving again): the
    frames they disagree on most, or where the rejected one gave NaN, kept as the job's evidence."""
    assert target.evidence is not None
    heap = target.evidence.heap()
    for image in list(run.frames):
        with target.slot.lease() as serving:
            if serving is None:
                return
            old, _, _ = predict(serving, image)
            serving_model = _model_name(serving)
        new, _, finite = predict(rejected, image)
        if finite:
            heap.offer(frame_agreement(old, new), image, old, new)
        else:
            heap.offer(0.0, image, old, new, note="rejected model's outputs NaN or Inf")
    if not len(heap):
        return
    failed = run.figures.failed if run.figures is not None else None
    guard.evidence(
        target.evidence.keep(
            guard.job_id,
            slot=target.slot.name,
            reason=f"unhealthy: {failed.figure}" if failed is not None else "unhealthy",
            serving_model=serving_model,
            candidate_model=_model_name(rejected),
            heap=heap,
        )
    )
