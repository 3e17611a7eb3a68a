"""What a running build is doing, for job status and up/info: phase, frames, elapsed, estimate.

The builder (and its child process) report steps as short text lines (``progress(message)``); this
turns them into a phase an operator reads (``slimming``, ``calibrating`` with frames done / total,
``building``, ``timing placements``) and bounds how often that is published: a child may say a
thousand lines a minute, and every publication is one more MQTT message per device.

No clock of its own (the caller passes ``now``), no I/O; a lock, since the build's lines and the
heartbeat that republishes elapsed seconds during a silent step come from two threads.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace
from typing import Literal

BuildPhase = Literal["planning", "slimming", "calibrating", "building", "timing placements", "checking"]

#: At most one published update per this many seconds per build (a phase change waits its turn too).
PUBLISH_INTERVAL_S = 2.0

#: ``calibrating 40/500 frames``: the line the builders say while calibration consumes frames.
_FRAMES = re.compile(r"calibrat\w*\D*?(\d+)\s*/\s*(\d+)\s*frames")
#: ``... (estimate 312s from 3 earlier builds)``: the builder's estimate, from its build history.
_ESTIMATE = re.compile(r"\(estimate (\d+(?:\.\d+)?)s from \d+ earlier builds?\)")

#: First words of a progress line -> its phase, checked in order (the first match wins).
_PHASES: tuple[tuple[str, BuildPhase], ...] = (
    ("onnxslim", "slimming"),
    ("slimming", "slimming"),
    ("calibrat", "calibrating"),
    ("placement", "timing placements"),
    ("timing", "timing placements"),
    ("int8 guard", "checking"),
    ("plan:", "planning"),
    ("cache miss", "building"),
    ("building", "building"),
    ("parsing", "building"),
    ("optimizing", "building"),
    ("built", "building"),
    ("quantiz", "building"),
)


def phase_of(message: str) -> BuildPhase | None:
    """The phase a progress line belongs to (None: a line that names none, e.g. ``cache hit``)."""
    text = message.strip().lower()
    for prefix, phase in _PHASES:
        if text.startswith(prefix):
            return phase
    return None


def frames_of(message: str) -> tuple[int, int] | None:
    """``(done, total)`` from a ``calibrating D/T frames`` line, else None."""
    match = _FRAMES.search(message.lower())
    if match is None:
        return None
    done, total = int(match.group(1)), int(match.group(2))
    return (min(done, total), total) if total > 0 else None


def estimate_of(message: str) -> float | None:
    """The estimate in seconds a ``cache miss`` line carries, else None."""
    match = _ESTIMATE.search(message)
    return float(match.group(1)) if match else None


def estimate_from(durations: list[float]) -> float | None:
    """The expected duration of a build from earlier ones of the same fingerprint: their median.

    The median, not the mean: one build slowed by a busy device must not move the estimate of the
    next. None without history."""
    ordered = sorted(d for d in durations if d >= 0)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class BuildProgress:
    """One build's state as published (``elapsed_s`` is filled at publication)."""

    phase: BuildPhase = "planning"
    frames_done: int | None = None
    frames_total: int | None = None
    estimate_s: float | None = None
    started: float = 0.0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"phase": self.phase, "elapsed_s": round(self.elapsed_s, 1)}
        if self.frames_total is not None:
            out.update(frames_done=self.frames_done, frames_total=self.frames_total)
        if self.estimate_s is not None:
            out["estimate_s"] = round(self.estimate_s, 1)
        return out


class ProgressTracker:
    """Folds a build's progress lines into a :class:`BuildProgress`, publishing at a bounded rate.

    :meth:`update` returns the progress to publish now, or None when the last publication is less
    than ``interval_s`` old (the newest state is kept and goes out with the next allowed one). A
    phase left before any publication showed it (a calibration pass of a second) is not lost: its
    last state goes out first at the next allowed publication, then the newest; at most one such
    state per phase waits, so the bound holds."""

    def __init__(self, started: float, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self.state = BuildProgress(started=started)
        #: What the last publication showed (the newest state until one was published).
        self.shown = self.state
        self.interval_s = interval_s
        self._last_published: float | None = None
        self._published_phases: set[BuildPhase] = set()
        #: The last state of each phase left unpublished, oldest first.
        self._missed: list[BuildProgress] = []
        self._lock = threading.Lock()

    def update(self, message: str, now: float) -> BuildProgress | None:
        phase = phase_of(message)
        frames = frames_of(message)
        estimate = estimate_of(message)
        with self._lock:
            state = self.state
            if frames is not None:
                phase = "calibrating"
            if phase is not None and phase != state.phase:
                self._left(state)
                state = replace(state, phase=phase, frames_done=None, frames_total=None)
            if frames is not None:
                state = replace(state, frames_done=frames[0], frames_total=frames[1])
            if estimate is not None:
                state = replace(state, estimate_s=estimate)
            self.state = state
            if self._last_published is None:
                self.shown = state
        return self.due(now)

    def _left(self, state: BuildProgress) -> None:
        """``state``'s phase ends: kept to be published if no publication showed that phase."""
        if state.phase in self._published_phases or state.phase == "planning":
            return
        self._missed = [m for m in self._missed if m.phase != state.phase] + [state]

    def due(self, now: float) -> BuildProgress | None:
        """The state to publish if the interval allows it now (the heartbeat calls this alone: a
        step that says nothing for minutes still shows its elapsed seconds move)."""
        with self._lock:
            if self._last_published is not None and now - self._last_published < self.interval_s:
                return None
            self._last_published = now
            chosen = self._missed.pop(0) if self._missed else self.state
            self._published_phases.add(chosen.phase)
            self.shown = replace(chosen, elapsed_s=max(0.0, now - chosen.started))
            return self.shown
