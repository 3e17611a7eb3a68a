"""What a device's reply to the ``status`` command says of a deploy's job: nothing, its end (the job's
own message was missed), or a note naming the field of a malformed reply.

A deploy asks a device that stayed quiet (:class:`~agent.fleet.deploy.run.FleetDeploy`); the reply
names the slot's last job and, once it ended, the job's final status message as the device published
it. Everything in it is checked like any message: a device's bad reply is a note on that device, never
an exception that ends the deploy for the others.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from agent.protocol.messages import CommandReply, JobState, JobStatus, ProtocolError


def job_end_of_reply(reply: CommandReply, slot: str, job_id: str) -> JobStatus | str | None:
    """The end of job ``job_id`` on ``slot`` that ``reply`` reports (a terminal :class:`JobStatus`),
    a note on a malformed reply (``str``), or None (another job, or not ended yet)."""
    if not reply.ok and reply.error_code == ProtocolError.code:
        # PendingReplies turned a reply that did not parse into this error reply.
        return f"status reply: {reply.error}"
    record = last_job(reply.result, slot) if reply.ok else None
    if record is None or record.get("job_id") != job_id:
        return None
    try:
        last = LastJob.model_validate(record)
    except ValidationError as exc:
        where = f"result.delivery.slots.{slot}.last_job"
        problems = "; ".join(
            f"{'.'.join((where, *(str(p) for p in e['loc'])))}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        return f"status reply: {problems}"
    return last.final_status(job_id, slot) if last.state.terminal else None


class LastJob(BaseModel):
    """The part of a ``status`` reply's ``last_job`` record the deploy reads (the rest is ignored).

    Validated like any message: a device's ``error_code: 12345`` is a malformed reply of that
    device, not a crash of the deploy.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    job_id: str
    state: JobState
    error_code: str | None = None
    #: The job's last status message as the device published it (same ``msg_id``), with its shadow
    #: and probation figures: the end a rollout's gate judges, whoever missed the message itself.
    status: JobStatus | None = None

    def final_status(self, job_id: str, slot: str) -> JobStatus:
        """The terminal status to apply: the device's own message when the record kept it (a device
        whose ledger predates it answers without one: its state and error code, no figures)."""
        kept = self.status
        if kept is not None and kept.job_id == job_id and kept.slot == slot and kept.state is self.state:
            return kept
        return JobStatus(
            job_id=job_id,
            slot=slot,
            state=self.state,
            error_code=self.error_code,
            error="final state read with the status command (its job message was missed)",
        )


def last_job(result: dict[str, Any] | None, slot: str) -> dict[str, Any] | None:
    """``result.delivery.slots[slot].last_job`` of a ``status`` reply, if it is there."""
    try:
        record = (result or {})["delivery"]["slots"][slot]["last_job"]
    except (KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None
