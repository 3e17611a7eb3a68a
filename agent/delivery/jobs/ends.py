"""How each slot's last job ended, and its last failure: what ``up/info`` shows an operator.

The job ledger keeps the last *accepted* job of a slot; a manifest refused before it runs never
reaches it. Every terminal status passes here on its way out, so ``up/info`` can name the job that
really ended last (a ``REJECTED`` deploy included) and the last failure, with its message. Kept in
memory: after a restart the ledger still says how its last job ended (without the message).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from agent.delivery.jobs.ledger import JobRecord
from agent.protocol.messages import JobEnd, JobState, JobStatus

log = structlog.get_logger(__name__)

#: Ends that are failures (``up/info``'s ``last_failure``); SUPERSEDED is not one: nothing to fix.
FAILURE_ENDS = frozenset({JobState.FAILED, JobState.REJECTED, JobState.ROLLED_BACK})
#: Longest error message kept in ``up/info`` per end (the job message carries all of it).
_END_ERROR_CHARS = 300


class JobEnds:
    """Per slot, the last job end and the last failure; ``on_end(slot)`` is told after each end."""

    def __init__(self, on_end: Callable[[str], None] | None = None) -> None:
        # Its own lock: ends are noted while other locks of the service are held.
        self._lock = threading.Lock()
        self._ends: dict[str, JobEnd] = {}
        self._failures: dict[str, JobEnd] = {}
        self._on_end = on_end

    def note(self, status: JobStatus) -> None:
        """Keep how the job ended (call with every terminal status) and say so."""
        error = status.error[:_END_ERROR_CHARS] if status.error else None
        end = JobEnd(
            job_id=status.job_id, state=status.state, error_code=status.error_code, error=error, ts=status.ts
        )
        with self._lock:
            self._ends[status.slot] = end
            if status.state in FAILURE_ENDS:
                self._failures[status.slot] = end
        if self._on_end is not None:
            try:
                self._on_end(status.slot)
            except Exception as exc:  # noqa: BLE001 - reporting must not fail the job that ended
                log.warning("delivery.job_end.report_failed", slot=status.slot, error=repr(exc))

    def fields(self, slot: str, record: JobRecord | None) -> dict[str, Any]:
        """``up/info``'s job fields of ``slot``: last job (a refused one too), its state, last failure.

        ``record`` is the ledger's last job of the slot.
        """
        with self._lock:
            end, failure = self._ends.get(slot), self._failures.get(slot)
        fields: dict[str, Any] = {"last_failure": failure}
        refused_later = (
            end is not None
            and end.state is JobState.REJECTED
            and (record is None or end.ts >= record.updated_at)
        )
        if end is not None and (refused_later or (record is not None and end.job_id == record.job_id)):
            # The end of the ledger's job (recorded there a moment later), or a manifest refused after
            # it (never in the ledger). Another job's end (SUPERSEDED by the ledger's) is older news.
            fields.update(last_job=end.job_id, last_job_state=end.state, last_job_error_code=end.error_code)
        elif record is not None:
            fields.update(
                last_job=record.job_id, last_job_state=record.state, last_job_error_code=record.error_code
            )
        if failure is None and record is not None and record.state in FAILURE_ENDS:
            # After a restart: the ledger still knows how the last job failed (not its message).
            fields["last_failure"] = JobEnd(
                job_id=record.job_id, state=record.state, error_code=record.error_code, ts=record.updated_at
            )
        return fields
