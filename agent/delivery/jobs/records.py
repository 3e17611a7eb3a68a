"""The job ledger as the delivery service keeps it: record first, and a full disk does not forget.

Every state change of a job is recorded in ``jobs.json`` (:class:`~agent.delivery.jobs.ledger.JobLedger`)
before it is published. When the disk refuses a terminal record, this process still knows the job
is over (a redelivered manifest must not resume it): the record is kept in memory and written by
:meth:`JobRecords.write_unrecorded` once the disk takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from agent.delivery.jobs.ledger import JobLedger, JobRecord
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState, JobStatus

log = structlog.get_logger(__name__)


class JobRecords:
    """The slot's last job per slot, from the ledger or from memory while the disk is full."""

    def __init__(self, ledger: JobLedger, *, on_unrecorded: Callable[[], None] | None = None) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()
        #: Told after the disk refused a terminal record (the upkeep then writes it once it can).
        self._on_unrecorded = on_unrecorded
        #: Per slot, a terminal record the full disk refused.
        self._unrecorded: dict[str, JobRecord] = {}
        #: Refused job ids the full disk did not take: still ended for this process.
        self._refused: set[str] = set()

    def record(self, manifest: DeployManifest, status: JobStatus) -> None:
        """Make ``status`` the ledger's record of its job (raises OSError when it cannot be written).

        QUEUED makes the job the slot's last; later states are recorded only while it still is: a
        newer job may have been recorded concurrently, and must never be overwritten.
        """
        record = record_of(manifest, status)
        with self._lock:
            if status.state is not JobState.QUEUED:
                last = self._last_locked(manifest.slot)
                if last is None or last.job_id != manifest.job_id:
                    if status.state.terminal and last is not None and last.sequence > manifest.sequence:
                        # Superseded by the slot's newer job: not its last, but ended all the same. A
                        # re-published manifest of it is then ignored, not refused with a second end.
                        # (Not a job whose QUEUED the full disk refused: that one is retried.)
                        self._remember_ended_locked(manifest.job_id)
                    return
            self._write_locked(record)

    def end_interrupted(self, record: JobRecord, *, by: str) -> JobStatus:
        """End the slot's last job ``record`` SUPERSEDED by job ``by``; the status to publish.

        For a job a stop or kill interrupted whose retained manifest a newer one replaced while the
        agent was down: it will never resume, and without this it would never end. Recorded before
        the newer job's QUEUED, so a kill between the two still finds it to end after the restart;
        a disk that refuses the record leaves it ended in this process (and logged).
        """
        last = record.status
        status = JobStatus(
            job_id=record.job_id,
            slot=record.slot,
            state=JobState.SUPERSEDED,
            error_code="superseded",
            error=f"superseded by job {by}, published while the agent was down",
            # The figures it had when interrupted: what the operator last saw of it.
            timings_s=last.timings_s if last is not None else {},
            requested=last.requested if last is not None else None,
            effective=last.effective if last is not None else None,
            shadow=last.shadow if last is not None else None,
            probation=last.probation if last is not None else None,
        )
        log.info("delivery.job.state", job=record.job_id, slot=record.slot, state=status.state.value, by=by)
        ended = record.model_copy(
            update={
                "state": status.state,
                "error_code": status.error_code,
                "status": status,
                "updated_at": status.ts,
            }
        )
        with self._lock:
            try:
                self._write_locked(ended)
            except OSError as exc:
                log.error(
                    "delivery.job.record_failed", job=record.job_id, state=status.state.value, error=str(exc)
                )
        return status

    def _remember_ended_locked(self, job_id: str) -> None:
        try:
            self.ledger.remember_ended(job_id)
        except OSError as exc:
            self._refused.add(job_id)
            log.warning("delivery.job.end_not_recorded", job=job_id, error=str(exc))

    def _write_locked(self, record: JobRecord) -> None:
        """Make ``record`` its slot's last in the ledger; a terminal one the disk refuses stays here."""
        try:
            self.ledger.record(record)
        except OSError:
            if record.state.terminal:
                # This process knows the job is over even if the disk does not yet: a redelivered
                # manifest must not resume it. The upkeep thread writes it once the disk takes it.
                self._unrecorded[record.slot] = record
                if self._on_unrecorded is not None:
                    self._on_unrecorded()
            raise
        self._unrecorded.pop(record.slot, None)

    def _last_locked(self, slot: str) -> JobRecord | None:
        return self._unrecorded.get(slot) or self.ledger.last(slot)

    def last(self, slot: str) -> JobRecord | None:
        """The slot's last job: the ledger's, or a terminal state the full disk has not taken yet."""
        with self._lock:
            return self._last_locked(slot)

    def has_ended(self, job_id: str) -> bool:
        """True when ``job_id`` reached a terminal state: in the ledger, or only in memory (disk full)."""
        with self._lock:
            if job_id in self._refused or any(r.job_id == job_id for r in self._unrecorded.values()):
                return True
            return self.ledger.has_ended(job_id)

    def remember_refused(self, job_id: str) -> None:
        """``job_id`` got its REJECTED without running: ended, in the ledger or (disk full) in memory."""
        with self._lock:
            try:
                self.ledger.remember_ended(job_id)
            except OSError as exc:
                # Known to this process anyway; a restart with the disk still full may report it again.
                self._refused.add(job_id)
                log.warning("delivery.job.refusal_not_recorded", job=job_id, error=str(exc))

    def unrecorded(self) -> int:
        """Terminal records the full disk refused, waiting for :meth:`write_unrecorded`."""
        with self._lock:
            return len(self._unrecorded)

    def write_unrecorded(self) -> None:
        """Write the terminal records a full disk refused, now that it may take them."""
        with self._lock:
            for slot, record in list(self._unrecorded.items()):
                try:
                    self.ledger.record(record)
                except OSError:
                    continue
                del self._unrecorded[slot]
                log.info("delivery.job.recorded_late", slot=slot, job=record.job_id, state=record.state.value)


def record_of(manifest: DeployManifest, status: JobStatus) -> JobRecord:
    """The ledger's record of ``manifest``'s job in the state ``status`` reports."""
    return JobRecord(
        job_id=manifest.job_id,
        slot=manifest.slot,
        sequence=manifest.sequence,
        sha256=manifest.sha256,
        model_id=manifest.model_id,
        version=manifest.version,
        state=status.state,
        error_code=status.error_code,
        status=status,
    )
