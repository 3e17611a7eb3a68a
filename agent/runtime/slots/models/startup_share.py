"""A start-up build joins the fleet: its engine swaps in through shadow and probation, then is offered.

A slot whose model came from a deployment that shared engines (``share_engines`` in its state.json
record) and whose engine is missing at start-up (after an upgrade changed every key) serves its
ONNX model while the builder asks the fleet, waits for another device's build, or builds under its
claim (:mod:`agent.engines.sharing.cache`). The engine then replaces the ONNX model the way a
deployment's does (:func:`~agent.runtime.slots.guarded.activate_guarded`): validated, a shadow against
the ONNX model on live frames, the swap, a probation against the ONNX model's health (the bars
of ``engines.startup_guard``). Rejected or unhealthy, the ONNX model keeps serving and nothing is
offered (the claim is released: another device builds). Healthy, an engine built here is offered
for its *start-up job* (:mod:`agent.engines.sharing.startup`): its ACTIVE status with the shadow and
probation figures is what the controller checks before it vouches.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog

from agent.delivery.jobs.steps import ActivationRequest, GuardReporter
from agent.engines.sharing.cache import FLEET_BUILT_BY
from agent.errors import EngineError
from agent.protocol.delivery_errors import JobCancelledError, RolledBackError, ShadowRejectedError
from agent.protocol.messages import JobState, ProbationFigures, ShadowFigures
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.runtime.slots.guarded import GuardedSlot, GuardRun, activate_guarded
from agent.runtime.slots.loaded import LoadedModel, ModelSource
from agent.runtime.slots.models.owner import SlotOwner
from agent.runtime.slots.models.sources import Origin

log = structlog.get_logger(__name__)


class _Figures:
    """The last shadow and probation figures the guarded swap reported."""

    def __init__(self) -> None:
        self.shadow: ShadowFigures | None = None
        self.probation: ProbationFigures | None = None

    def take(self, shadow: ShadowFigures | None, probation: ProbationFigures | None) -> None:
        self.shadow = shadow or self.shadow
        self.probation = probation or self.probation


def swap_guarded_and_offer(
    owner: SlotOwner, name: str, engine: ModelSource, origin: Origin, job_id: str
) -> bool:
    """Swap ``engine`` in for the interim ONNX model of slot ``name`` through shadow and probation
    (the caller holds the slot's lock), then offer it when built here; False when it was rejected
    (the ONNX model serves on)."""
    bars = owner.engines.config.startup_guard
    figures = _Figures()
    guard = GuardReporter(
        enter=lambda state: _entered(name, job_id, state),
        figures=figures.take,
        cancel=threading.Event(),
        job_id=job_id,
    )
    request = ActivationRequest(
        slot=name,
        engine_path=engine.path,
        backend=engine.backend,
        load_extra=dict(engine.extra),
        model_id=engine.model_id,
        version=engine.version or "",
        sha256=engine.sha256 or "",
        model_path=engine.model_path or engine.path,
        shadow=ShadowSpec(
            frames=bars.shadow_frames,
            min_agreement=bars.min_agreement,
            max_latency_ratio=bars.max_latency_ratio,
            timeout_s=bars.shadow_timeout_s,
        ),
        probation_s=bars.probation_s,
        probation=ProbationSpec(
            min_fps_ratio=bars.min_fps_ratio,
            max_p99_ratio=bars.max_p99_ratio,
            max_drop_increase=bars.max_drop_increase,
        ),
        guard=guard,
        share_engines=True,
    )
    runs: dict[str, GuardRun] = {}

    def record(source: ModelSource, loaded: LoadedModel) -> None:
        try:
            owner.record(name, source, loaded, origin)
        except OSError as exc:  # as the unguarded start-up swap: it serves, the next start chooses again
            log.error("agent.state.not_recorded", slot=name, model=loaded.ref.model_id, error=str(exc))

    target = GuardedSlot(
        slot=owner.slots[name],
        latest_frame=lambda: owner.latest_frame(name),
        record=record,
        activated=owner.activated,
        runs=runs,
        evidence=None,
    )
    fleet = owner.engines.builder.fleet
    key = engine.engine_key
    try:
        activate_guarded(target, request, engine)
    except (ShadowRejectedError, RolledBackError, JobCancelledError, EngineError) as exc:
        log.error(
            "slot.interim.guard_rejected", slot=name, job=job_id, error=str(exc)[:300], serving="interim"
        )
        if fleet is not None and key is not None:
            fleet.release(key, f"start-up shadow or probation failed: {exc}")
        return False
    log.info("slot.interim.guarded_swap", slot=name, job=job_id, **_shown(figures))
    if fleet is None or key is None:
        return True
    entry = owner.engines.builder.cache.get(key)
    if (
        entry is None
        or FLEET_BUILT_BY in entry.meta.extra
        or figures.shadow is None
        or figures.probation is None
    ):
        fleet.release(key, "not offered: downloaded from the fleet, evicted, or no figures")
        return True
    fleet.offer_after_startup(
        owner.engines.builder.cache,
        key,
        job_id=job_id,
        slot=name,
        shadow=figures.shadow,
        probation=figures.probation,
        model=(engine.model_id, engine.version),
    )
    return True


def _entered(slot: str, job_id: str, state: JobState) -> None:
    log.info("slot.interim.guard", slot=slot, job=job_id, phase=state.value)


def _shown(figures: _Figures) -> dict[str, Any]:
    return {
        "shadow": figures.shadow.model_dump() if figures.shadow else None,
        "probation_s": figures.probation.probation_s if figures.probation else None,
    }
