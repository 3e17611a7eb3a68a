"""The evidence a start-up build shows the controller before its engine is shared.

A build a slot runs at start-up (after an upgrade changed every key, after an eviction) has no
deployment job, yet trust rule 1 (docs/engines.md) holds for it as for a job: the engine is offered
only after it swapped in through a shadow against the ONNX model that served meanwhile and a
probation. The device names that run a *start-up job*, ``startup-{slot}-{unix seconds}``: its asks
and claim carry that id, and once the shadow and probation passed, it publishes the job's ACTIVE
status on ``up/jobs/{job_id}`` with their figures (as a deployment job does), then offers the engine
for that job id. The controller checks it as it checks a deployment's: ACTIVE in its view of the
device's ``up/jobs``, with shadow and probation figures.
"""

from __future__ import annotations

import re
import time

from agent.protocol.messages import JobState, JobStatus, ProbationFigures, ShadowFigures

#: How a start-up job id starts (a deployment's never does: the controller names those).
STARTUP_JOB_PREFIX = "startup-"
_SLOT_PART = re.compile(r"[^A-Za-z0-9_.-]")


def startup_job_id(slot: str, now: float | None = None) -> str:
    """The start-up job id of a build of ``slot`` starting now (one MQTT topic level, bounded)."""
    stamp = int(time.time() if now is None else now)
    return f"{STARTUP_JOB_PREFIX}{_SLOT_PART.sub('_', slot)[:64]}-{stamp}"


def startup_active_status(
    job_id: str, slot: str, shadow: ShadowFigures, probation: ProbationFigures
) -> JobStatus:
    """The start-up job's ACTIVE status, with the shadow and probation figures it passed."""
    return JobStatus(
        job_id=job_id,
        slot=slot,
        state=JobState.ACTIVE,
        progress=1.0,
        shadow=shadow,
        probation=probation,
        effective={"startup_build": True},
    )
