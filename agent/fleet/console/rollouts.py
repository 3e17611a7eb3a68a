"""Rollouts as the console shows them: waves, device counts per step and end, gate figures.

Read from the controller's :class:`~agent.fleet.rollout.store.RolloutStore`, the same file the
controller writes every transition to, so the page shows what a restarted controller would resume.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from agent.fleet.rollout.building import Builds, Waits, building_devices
from agent.fleet.rollout.precision import precision_summary, requested_precision
from agent.fleet.rollout.records import WaveState
from agent.fleet.rollout.report import rollback_outcome, rollout_policy
from agent.fleet.rollout.store import RolloutStore

#: Rollouts the rollouts page lists: the open ones and then the latest finished ones, up to this many.
ROLLOUTS_SHOWN = 20


def rollout_ids(store: RolloutStore, limit: int = ROLLOUTS_SHOWN) -> list[str]:
    """The open rollouts (oldest first), then the latest others, at most ``limit`` in all.

    The store lists only open rollouts (:meth:`RolloutStore.open_rollouts`); the finished ones
    come from :meth:`RolloutStore.recent_ids` (on SQLite, a read-only connection of its own to the
    same file, which never blocks the controller's writes).
    """
    ids = store.open_rollouts()
    recent = store.recent_ids(limit)
    ids += [r for r in recent if r not in ids]
    return ids[:limit]


def rollout_summary(
    store: RolloutStore,
    rollout_id: str,
    now: float | None = None,
    builds: Builds | None = None,
    waits: Waits | None = None,
) -> dict[str, Any]:
    """One rollout: state, slot, version, each wave's devices by step and end, gate figures, reason,
    and its devices building their engine now (``building``, from ``builds``: the controller's
    :meth:`~agent.fleet.view.live.FleetView.builds`; as ``status --json`` lists them, each waiting for
    whose build where ``waits`` says), and each wave's ``started_at`` and ``ended_at``.

    The shape follows ``edge-agent fleet rollout status --json`` (``policy``, ``waves[].index/state/
    devices/ends/reason``, ``rollback``) with the steps and the gate's figures added, and a soaking
    wave's ``soak_left_s``: whole seconds to its ``soak_until`` by the controller's clock ``now``
    (the browser's clock may be off; the page counts down from this figure).
    """
    now = time.time() if now is None else now
    rollout = store.rollout(rollout_id)
    devices = store.devices(rollout_id)
    steps: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ends: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in devices:
        steps[row.wave][row.step.value] += 1
        if row.end is not None:
            ends[row.wave][row.end.value] += 1
    building, building_left_off = building_devices(devices, builds or {}, waits)
    waves = [
        {
            "index": wave.index,
            "wave": wave.index + 1,  # as operators count them; index (0-based) stays for old readers
            "state": wave.state.value,
            "devices": sum(steps[wave.index].values()),
            "steps": dict(sorted(steps[wave.index].items())),
            "ends": dict(sorted(ends[wave.index].items())),
            "figures": wave.figures,
            "reason": wave.reason,
            "started_at": wave.started_at,
            "ended_at": wave.ended_at,
            "soak_left_s": _soak_left(wave.state, wave.figures, now),
        }
        for wave in store.wave_rows(rollout_id)
    ]
    return {
        "rollout_id": rollout.rollout_id,
        "state": rollout.state.value,
        "slot": rollout.slot,
        "job_id": rollout.job_id,
        "to_version": rollout.to_version,
        "reason": rollout.reason,
        "created_at": rollout.created_at,
        "updated_at": rollout.updated_at,
        # The policy, not the stored spec: that holds the manifest (a hash per chunk) and every
        # device id, which the page never shows and the live feed would resend on every change.
        "policy": rollout_policy(rollout.spec),
        "waves": waves,
        "devices": {
            "total": len(devices),
            "steps": dict(sorted(collections.Counter(r.step.value for r in devices).items())),
            "ends": dict(sorted(collections.Counter(r.end.value for r in devices if r.end).items())),
        },
        "rollback": rollback_outcome(store, rollout_id),
        "building": building,
        "building_left_off": building_left_off,
        # What its ACTIVE devices run against the precision asked (as ``status --json``'s).
        "precision": precision_summary(devices, requested_precision(rollout.spec.get("request", {}))),
    }


def _soak_left(state: WaveState, figures: dict[str, Any] | None, now: float) -> int | None:
    """Seconds a soaking wave has left (0 once due: the controller moves on at its next step)."""
    until = (figures or {}).get("soak_until")
    if state is not WaveState.SOAKING or not isinstance(until, (int, float)):
        return None
    return max(0, round(until - now))


def rollout_devices(store: RolloutStore, rollout_id: str) -> list[dict[str, Any]]:
    """The rollout's devices: wave, step, end, sends and the job's figures (error code, shadow...)."""
    return [
        {
            "device": row.device,
            "job_id": row.job_id,  # the rollout page links a shadow rejection to its evidence
            "wave": row.wave + 1,  # counted from 1, as the waves of the answer and the page are
            "step": row.step.value,
            "end": row.end.value if row.end else None,
            "from_version": row.from_version,
            "figures": row.figures,
            "sends": row.sends,
        }
        for row in store.devices(rollout_id)
    ]
