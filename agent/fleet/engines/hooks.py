"""What the controller process calls: its engine desk, built from its configuration, the two facts it
lends the desk (what its fleet view heard of a job; whether a rollout shares engines), and the
listing its ``engines`` verb and console answer with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.fleet.engines.desk import EngineDesk, JobFactsFn, PieceSink, Publish
from agent.fleet.engines.listing import with_withdrawn
from agent.fleet.engines.pg_index import PostgresEngineStore
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore
from agent.fleet.engines.trust import JobFacts, sharing_for
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.statedb.postgres import StateDatabase
from agent.fleet.view.live import FleetView
from agent.protocol.device_targets import target_kind
from agent.signing import Ed25519PrivateKey


def engine_desk_for(
    settings: EngineShareSettings,
    directory: Path,
    *,
    prefix: str,
    key: Ed25519PrivateKey | None,
    key_id: str | None,
    publish: Publish,
    job_facts: JobFactsFn,
    sink_for: Callable[[Path], PieceSink],
    database: StateDatabase | None = None,
) -> EngineDesk:
    """The controller's engine desk over its store in ``directory`` (``{state_dir}/engines``), its index
    in ``database`` when the controller's store is PostgreSQL; ``sink_for(blobs)``: the controller's
    upload sink on the store's blobs directory."""
    # Made once the controller holds the lease.
    store = (
        EngineStore(directory, settings, create=False)
        if database is None
        else PostgresEngineStore(directory, settings, database)
    )
    return EngineDesk(
        settings,
        store,
        prefix=prefix,
        signing_key=key,
        key_id=None if key is None else key_id,
        publish=publish,
        job_facts=job_facts,
        sink=sink_for(store.blobs),
    )


def job_facts_in(view: FleetView) -> JobFactsFn:
    """``job_facts(device, job_id)`` from the controller's live view of the devices' ``up/jobs``."""

    def facts(device: str, job_id: str) -> JobFacts | None:
        state = view.device(device)
        if state is None:
            return None
        for job in state.jobs:
            if job.job_id == job_id:
                return JobFacts(
                    state=job.state, shadow=job.shadow is not None, probation=job.probation is not None
                )
        return None

    return facts


def share_engines_of(
    request: RolloutRequest, settings: EngineShareSettings, *, can_sign: bool
) -> RolloutRequest:
    """``request`` with its ``share_engines`` decided (stored with the rollout, so a resumed rollout
    publishes the same manifests): its flag, else the controller's setting, never without a key; a
    device target (a configuration, an agent release) has no engine to share."""
    if target_kind(request.slot) != "model":
        return request
    share = sharing_for(request.share_engines, settings.share, can_sign=can_sign)
    return request.model_copy(update={"share_engines": share})


def engines_listing(desk: EngineDesk) -> dict[str, Any]:
    """``fleet engines list --json`` and the console's engines page: the engines held per fingerprint
    and the ones withdrawn. Any thread (the engine store takes its own lock)."""
    return with_withdrawn(desk.listing(), desk.store.withdrawn(), desk.store.withdrawn_notes())
