"""The last deployment job of each slot, and the ids of recently ended jobs, in ``<state_dir>/jobs.json``.

It is what reconcile compares a desired manifest against: the same job id already finished means
nothing to do; a job recorded but not finished (the agent stopped or crashed during it) is resumed;
a sequence not above the recorded one is a replay. Written atomically on every state change, *before*
that state is published (the record holds the exact status message, which is what gets published): a
kill between the two can lose a publication, never make a finished job run again. A corrupt file is
set aside and the agent starts with no job history rather than not starting.

The ended ids (the last :data:`ENDED_MAX`, any slot, refused manifests included) are what keeps the
rule "one terminal state per job id" (docs/protocol.md, "JobStatus"): a manifest of a job that ended is
ignored, not refused again, however it comes back (re-published, on another slot's topic, after a
restart) and though a newer job replaced it as its slot's last.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Protocol

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.fsutil import atomic_write_json
from agent.protocol.messages import JobState, JobStatus

log = structlog.get_logger(__name__)

JOBS_FILE_NAME = "jobs.json"
#: Ended job ids remembered (some 40 KB of JSON): far more than the manifests a broker still retains
#: or an operator re-publishes by hand for one device.
ENDED_MAX = 1000


class JobRecord(BaseModel):
    """The last job of one slot."""

    # Unknown keys ignored: an older agent must read what a newer one wrote.
    model_config = ConfigDict(extra="ignore", frozen=True)

    job_id: str
    slot: str
    sequence: int
    sha256: str
    model_id: str
    version: str
    state: JobState = Field(description="Last state published; terminal when the job is done.")
    error_code: str | None = None
    updated_at: float = Field(default_factory=time.time)
    status: JobStatus | None = Field(
        default=None,
        description="The status message of ``state`` as published (same msg_id): a terminal one is "
        "published again from here after a restart, in case the kill came before it reached the spool.",
    )

    @property
    def done(self) -> bool:
        """True when the job reached a terminal state (it will not run again)."""
        return self.state.terminal


class JobLedger(Protocol):
    """Where the delivery service keeps the last job per slot."""

    def last(self, slot: str) -> JobRecord | None:
        """The last job accepted for ``slot``, or None."""

    def record(self, record: JobRecord) -> None:
        """Make ``record`` the last job of its slot (persisted before returning)."""

    def all(self) -> dict[str, JobRecord]:
        """The last job of every slot."""

    def has_ended(self, job_id: str) -> bool:
        """True when ``job_id`` reached a terminal state (recorded, or remembered as refused)."""

    def remember_ended(self, job_id: str) -> None:
        """Remember ``job_id`` as ended though no slot ran it (a refused manifest); persisted."""


class _JobsDoc(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_version: int = 1
    slots: dict[str, JobRecord] = Field(default_factory=dict)
    #: Ids of ended jobs, oldest first, at most ENDED_MAX (absent in files of older agents).
    ended: list[str] = Field(default_factory=list)


def _with_ended(ended: list[str], job_id: str) -> list[str]:
    """``ended`` with ``job_id`` moved to the end, the oldest dropped beyond ENDED_MAX."""
    return [*(j for j in ended if j != job_id), job_id][-ENDED_MAX:]


class JobsFile:
    """:class:`JobLedger` in a JSON file, rewritten atomically; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._doc = self._load()

    @classmethod
    def in_dir(cls, state_dir: Path) -> JobsFile:
        """The jobs file of the agent whose state directory is ``state_dir``."""
        return cls(Path(state_dir) / JOBS_FILE_NAME)

    def _load(self) -> _JobsDoc:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _JobsDoc()
        except OSError as exc:
            log.error("delivery.jobs_file.unreadable", path=str(self.path), error=str(exc))
            return _JobsDoc()
        try:
            return _JobsDoc.model_validate(json.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, ValueError, ValidationError) as exc:
            target = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            try:
                self.path.rename(target)
            except OSError:
                target = self.path
            # Replay protection restarts from zero for every slot: say so loudly.
            log.error("delivery.jobs_file.corrupt", path=str(self.path), moved_to=str(target), error=str(exc))
            return _JobsDoc()

    def last(self, slot: str) -> JobRecord | None:
        with self._lock:
            return self._doc.slots.get(slot)

    def all(self) -> dict[str, JobRecord]:
        with self._lock:
            return dict(self._doc.slots)

    def has_ended(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._doc.ended

    def record(self, record: JobRecord) -> None:
        with self._lock:
            slots = {**self._doc.slots, record.slot: record}
            ended = _with_ended(self._doc.ended, record.job_id) if record.done else self._doc.ended
            self._write(_JobsDoc(slots=slots, ended=ended))

    def remember_ended(self, job_id: str) -> None:
        with self._lock:
            self._write(_JobsDoc(slots=self._doc.slots, ended=_with_ended(self._doc.ended, job_id)))

    def _write(self, doc: _JobsDoc) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, doc.model_dump(mode="json"))
        self._doc = doc
