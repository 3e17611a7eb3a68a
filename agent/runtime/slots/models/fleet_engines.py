"""A deployment's engine and the fleet: offered once ACTIVE, rebuilt here when a fleet engine fails.

The trust rules (docs/engines.md, "Engines for the whole fleet"): an engine is offered to the
controller only after this device built it and ran it to ACTIVE through shadow *and* probation; a
fleet engine is validated, shadowed and put on probation here as if built here, and one that fails
to load or validate is dropped (the controller hears of it and withdraws it fleet-wide) and the
job goes on with an engine built here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import partial
from pathlib import Path

import structlog

from agent.delivery.jobs.steps import ActivationRequest
from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.engine_fetch import fetch_engine_file
from agent.delivery.transfer.pull import fetch_model
from agent.engines.service import EngineService, PreparedEngine
from agent.engines.sharing.cache import FleetEngineCache
from agent.engines.sharing.imported import ImportedEngines
from agent.engines.sharing.link import MqttEngineRequests
from agent.errors import BuildError, EngineError
from agent.mqtt.link import MqttLink
from agent.protocol.delivery_errors import JobCancelledError
from agent.protocol.topics import Topics
from agent.runtime.slots.loaded import ModelSource
from agent.signing import Ed25519PublicKey
from agent.specs.build import BuildSpec

log = structlog.get_logger(__name__)

#: A fleet engine download that gets no chunk for this long is a miss and the device builds: the
#: controller may have evicted or withdrawn the engine after answering the ask, and without this the
#: job would wait the whole ``delivery.job_deadline_s`` for chunks nobody sends.
ENGINE_STALL_S = 60.0


def fleet_cache_for(
    link: MqttLink,
    topics: Topics,
    trusted: Mapping[str, Ed25519PublicKey],
    delivery: DeliveryConfig,
    state_dir: Path,
    *,
    ask_timeout_s: float,
    wait_max_s: float = 1200.0,
) -> FleetEngineCache:
    """The engine cache's second level for the running agent: requests over its MQTT link, files
    pulled by the delivery fetch, records checked against the keys its manifests are checked with."""
    fetch = partial(fetch_model, link=link, topics=topics, config=delivery, stall_s=ENGINE_STALL_S)
    return FleetEngineCache(
        MqttEngineRequests(link, topics),
        trusted,
        partial(fetch_engine_file, fetch=fetch),
        work_dir=state_dir / "fleet-engines",
        ask_timeout_s=ask_timeout_s,
        wait_max_s=wait_max_s,
        imported=ImportedEngines(state_dir),
    )


def offer_when_active(
    engines: EngineService, request: ActivationRequest, source: ModelSource, *, guarded: bool
) -> None:
    """The job's engine went ACTIVE: offer it to the fleet when the manifest shares engines, the job
    ran shadow and probation (``guarded``: the slot served a model to guard against), and this device
    built it (a fleet engine is not offered back)."""
    fleet = engines.builder.fleet
    if fleet is None or source.engine_key is None:
        return
    if not guarded or not request.share_engines:
        fleet.release(source.engine_key, "its job ran no shadow and probation: nothing to offer")
        return
    job_id = request.guard.job_id if request.guard is not None else ""
    fleet.offer_in_background(
        engines.builder.cache,
        source.engine_key,
        job_id=job_id or request.version,
        shadow=request.shadow is not None,
        probation_s=request.probation_s,
        model=(request.model_id, request.version),
    )


def release_claim(engines: EngineService, key: str, reason: str) -> None:
    """This device will offer no engine for ``key``: a build claim it holds ends (no-op otherwise)."""
    engines.builder.release_claim(key, reason)


def release_job_claims(
    engines: EngineService, job_id: str, reason: str, *, keep: Collection[str] = ()
) -> None:
    """Job ``job_id`` works on no other key than ``keep`` now: every other claim it holds ends."""
    if engines.builder.fleet is not None and job_id:
        engines.builder.fleet.release_job(job_id, reason, keep=keep)


def dropped_fleet_engine(engines: EngineService, source: ModelSource, error: EngineError) -> bool:
    """``source`` was a fleet engine that failed to load or validate with ``error``: dropped (and
    reported to the controller). False when it was no fleet engine (nothing done)."""
    fleet = engines.builder.fleet
    key = source.engine_key
    return fleet is not None and key is not None and fleet.dropped(engines.builder.cache, key, str(error))


def build_here(
    engines: EngineService,
    request: ActivationRequest,
    source: ModelSource,
    spec: BuildSpec,
    error: EngineError,
) -> PreparedEngine:
    """The engine built here instead of the dropped fleet engine that failed with ``error`` (the
    step :func:`agent.engines.building.fallback.after_load_failure` names). Raises EngineError when the build
    here fails too."""
    cancel = request.guard.cancel if request.guard is not None else None
    log.warning("slot.fleet_engine_failed", slot=request.slot, key=source.engine_key, error=str(error)[:300])
    try:
        # The key is refused now: this build does not ask the fleet again.
        prepared = engines.prepare(
            request.slot,
            request.model_path,
            spec,
            source.preprocess,
            progress=lambda message: log.info("engine.build.progress", slot=request.slot, message=message),
            cancel=cancel,
        )
    except BuildError as exc:
        if cancel is not None and cancel.is_set():
            raise JobCancelledError(
                f"slot {request.slot}: build after a failed fleet engine cancelled"
            ) from exc
        raise EngineError(
            f"the fleet's engine failed here ({error}); the build here failed too: {exc}"
        ) from exc
    if request.on_fallback is not None:
        request.on_fallback({**prepared.effective, "fleet_engine_failed": str(error)[:300]})
    return prepared
