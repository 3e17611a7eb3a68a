"""What the rollout store knows of each device's last jobs, for a restarted controller's live view.

The fleet view hears jobs on ``up/jobs/{job_id}``, which is not retained: after a restart it has
none until a device publishes again. The devices' retained ``up/info`` names each slot's last job
and how it ended (the view takes those itself); the store has, per device of each rollout, the job
id, its state and failure code, and the shadow and probation figures the device published. This
turns the latest rollouts' device rows into :class:`~agent.fleet.view.device_record.JobSeen` records that
:meth:`~agent.fleet.view.live.FleetView.remember_jobs` takes.
"""

from __future__ import annotations

from agent.fleet.rollout.store import RolloutStore, RolloutStoreError
from agent.fleet.view.device_record import MAX_JOBS, JobSeen

#: Rollouts read (the latest first): enough for MAX_JOBS jobs per device in any real history.
ROLLOUTS_READ = 50


def jobs_from_store(store: RolloutStore, rollouts: int = ROLLOUTS_READ) -> dict[str, list[JobSeen]]:
    """Each device's jobs the store recorded a state for (at most MAX_JOBS, the latest first).

    ``at`` is when the store recorded the job's end (or its send): the controller's clock, where a
    job heard on ``up/jobs`` has the device's. A store that cannot be read gives nothing (the view
    then rebuilds from the retained ``up/info`` alone).
    """
    found: dict[str, list[JobSeen]] = {}
    try:
        for rollout in store.rollouts(rollouts):
            for row in store.devices(rollout.rollout_id):
                figures = row.figures or {}
                state = figures.get("state")
                at = row.ended_at or row.sent_at
                if not isinstance(state, str) or at is None:
                    continue  # never sent, or no state heard: nothing the device did
                jobs = found.setdefault(row.device, [])
                if len(jobs) < MAX_JOBS:
                    jobs.append(
                        JobSeen(
                            job_id=row.job_id,
                            slot=rollout.slot,
                            state=state,
                            at=at,
                            error_code=_text(figures.get("error_code")),
                            error=None,
                            shadow=_figures(figures.get("shadow")),
                            probation=_figures(figures.get("probation")),
                        )
                    )
    except RolloutStoreError:
        return {}
    return found


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _figures(value: object) -> dict[str, object] | None:
    return value if isinstance(value, dict) else None
