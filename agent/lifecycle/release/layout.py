"""The releases directory on disk and its records, in the standard library only (the launcher reads them).

``{state_dir}/releases/``::

    <version>/          one virtual environment per release; ``.complete`` inside once pip finished
    current -> <version>   what the launcher starts
    good -> <version>      the last confirmed release: the unit runs the launcher from it
    update.json         the update in progress (job, previous, candidate, deadline, attempts), if any
    outcome.json        how the last update ended (job, version, active or rolled_back, reason)
    wheels/<sha256>/<file>.whl   every wheel held, by hash

Every record is written temp + fsync + rename and every link is switched by renaming a new link over
it, so a kill at any moment leaves the old or the new file, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.fsutil import atomic_write_json, fsync_directory

CURRENT = "current"
GOOD = "good"
UPDATE_RECORD = "update.json"
OUTCOME_RECORD = "outcome.json"
WHEELS = "wheels"
#: Written inside a release's environment, last, once it is fully installed.
COMPLETE = ".complete"
#: The environment the launcher sets for the agent it starts: which release it is, and where releases live.
RELEASE_ENV = "EDGE_AGENT_RELEASE"
RELEASES_ENV = "EDGE_AGENT_RELEASES"
#: Test-only: the name of a step at which the process SIGKILLs itself (see :func:`stop_point`).
STOP_AT_ENV = "EDGE_AGENT_TEST_STOP_AT"


# update.json ``state``: the candidate is being started and watched; confirmed (good is being moved to
# it); reverting (current is being moved back to the previous release, ``reason`` says why).
WATCHING = "watching"
CONFIRMING = "confirming"
REVERTING = "reverting"


def stop_point(step: str) -> None:
    """Test-only: SIGKILL this process at ``step`` when :data:`STOP_AT_ENV` names it (the kill tests
    prove a device survives a kill at every step); one dictionary look-up otherwise."""
    if os.environ.get(STOP_AT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class PendingUpdate:
    """update.json: an agent release applied and not yet confirmed or put back."""

    job_id: str
    previous: str
    candidate: str
    #: Unix time by which the candidate must be confirmed, and the window it was given (seconds).
    deadline: float
    deadline_s: float
    #: How long the candidate must stay healthy to be confirmed, seconds.
    confirm_s: float
    #: Starts of the candidate allowed before it is put back.
    max_attempts: int
    state: str = WATCHING
    #: Starts of the candidate so far (the launcher counts them).
    attempts: int = 0
    #: Starts that reached the agent's start-up (the agent counts them): fewer than attempts means it
    #: crashed before (at import).
    started: int = 0
    reason: str | None = None
    #: The health reading taken before the change (HealthReading's fields as lists).
    before: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpdateOutcome:
    """outcome.json: how the last update ended."""

    job_id: str
    version: str
    #: "active" (confirmed) or "rolled_back".
    outcome: str
    reason: str | None = None
    #: The release that ran before the update (kept on disk beside the confirmed one).
    previous: str | None = None


class Releases:
    """The releases directory of one device."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def release_dir(self, version: str) -> Path:
        return self.root / version

    def python(self, version: str) -> Path:
        return self.release_dir(version) / "bin" / "python"

    def is_complete(self, version: str) -> bool:
        return (self.release_dir(version) / COMPLETE).is_file()

    def link(self, name: str) -> str | None:
        """The release ``name`` (current, good) points at, or None when it is missing."""
        try:
            target = os.readlink(self.root / name)
        except OSError:
            return None
        return Path(target).name

    def switch(self, name: str, version: str) -> None:
        """Point link ``name`` at ``version`` atomically: a new link under another name renamed over it."""
        if self.link(name) == version:
            return
        temp = self.root / f".{name}.new"
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        os.symlink(version, temp)
        stop_point(f"{name}-link-written")
        os.replace(temp, self.root / name)
        fsync_directory(self.root)

    def read_update(self) -> PendingUpdate | None:
        data = _read_json(self.root / UPDATE_RECORD)
        return None if data is None else PendingUpdate(**data)

    def write_update(self, update: PendingUpdate) -> None:
        atomic_write_json(self.root / UPDATE_RECORD, asdict(update))

    def clear_update(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / UPDATE_RECORD).unlink()
            fsync_directory(self.root)

    def read_outcome(self) -> UpdateOutcome | None:
        data = _read_json(self.root / OUTCOME_RECORD)
        return None if data is None else UpdateOutcome(**data)

    def write_outcome(self, outcome: UpdateOutcome) -> None:
        atomic_write_json(self.root / OUTCOME_RECORD, asdict(outcome))

    def finish_revert(self, update: PendingUpdate) -> None:
        """Put the previous release back as current and record why (each step idempotent)."""
        self.switch(CURRENT, update.previous)
        stop_point("reverted-link")
        self.write_outcome(
            UpdateOutcome(update.job_id, update.candidate, "rolled_back", update.reason, update.previous)
        )
        stop_point("reverted-outcome")
        self.clear_update()

    def finish_confirm(self, update: PendingUpdate) -> None:
        """Make the candidate the last good release and record it (each step idempotent)."""
        self.switch(GOOD, update.candidate)
        stop_point("confirmed-good")
        self.write_outcome(UpdateOutcome(update.job_id, update.candidate, "active", None, update.previous))
        stop_point("confirmed-outcome")
        self.clear_update()


def running_release() -> str | None:
    """The release this process runs from, as the launcher named it; None when not started by it."""
    return os.environ.get(RELEASE_ENV) or None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"{path}: not a JSON object")
    return data
