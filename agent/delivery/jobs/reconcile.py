"""What to do with a desired-state manifest: a pure decision, so its rules carry the unit tests.

Rules (docs/protocol.md, "Desired state"):

* the job is running or queued already -> ``ignore`` (a retained manifest comes again on every
  reconnect, and QoS 1 may repeat it);
* the slot's last job id under another sequence -> ``ignore``: that job id has its states already,
  and a refusal would put a second terminal state on it;
* the same job id finished before -> ``ignore`` (a failed job is retried only by a new manifest),
  except a job that ended ``FAILED`` with ``disk_full``: ``wait_for_space``, and ``apply`` when the
  service retries it because space returned (``retry=True``);
* the same job id recorded but not finished (the agent stopped during it) -> ``apply`` (resume);
* a job id that ended before, in any slot (``ended``) -> ``ignore``: one terminal state per job id;
* a sequence above the last accepted one for the slot -> ``apply`` (it supersedes a running job);
* otherwise -> ``replay``: an older or equal sequence under a new job id is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from agent.delivery.jobs.ledger import JobRecord
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState

#: The error code of a job that failed for want of disk space (:class:`~agent.errors.DiskFullError`).
DISK_FULL = "disk_full"


class Action(str, enum.Enum):
    IGNORE = "ignore"
    APPLY = "apply"
    REPLAY = "replay"
    #: The job ended FAILED disk_full: the service retries it by itself once space returns.
    WAIT_FOR_SPACE = "wait_for_space"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(
    manifest: DeployManifest,
    last: JobRecord | None,
    in_flight: Collection[str],
    *,
    retry: bool = False,
    ended: bool = False,
) -> Decision:
    """Decide for ``manifest`` given the slot's last recorded job and the ids queued or running now.

    ``retry``: the service asks again for a job that failed ``disk_full``, because space returned.
    ``ended``: the manifest's job id reached a terminal state before (any slot, the ledger's history).
    """
    if manifest.job_id in in_flight:
        return Decision(Action.IGNORE, "job already queued or running")
    if last is not None and last.job_id == manifest.job_id:
        if manifest.sequence != last.sequence:
            return Decision(
                Action.IGNORE,
                f"job id {manifest.job_id!r} was accepted with sequence {last.sequence}, not "
                f"{manifest.sequence}; a new attempt needs a new job id",
            )
        if last.done and last.state is JobState.FAILED and last.error_code == DISK_FULL:
            if retry:
                return Decision(Action.APPLY, "retrying: disk space returned")
            return Decision(Action.WAIT_FOR_SPACE, "job failed disk_full; retried when space returns")
        if last.done:
            return Decision(Action.IGNORE, f"job already finished ({last.state.value})")
        return Decision(Action.APPLY, "job was interrupted; resuming")
    if ended:
        return Decision(
            Action.IGNORE, f"job {manifest.job_id!r} already ended; a new attempt needs a new job id"
        )
    if last is None or manifest.sequence > last.sequence:
        return Decision(Action.APPLY, "newer sequence")
    return Decision(
        Action.REPLAY,
        f"sequence {manifest.sequence} is not newer than {last.sequence} (job {last.job_id!r}) for slot "
        f"{manifest.slot!r}; publish a manifest with a higher sequence",
    )
