"""Where a deploy stands and how it ended, per device, with the lines an operator reads about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from agent.protocol.messages import JobState

#: Malformed-message notes kept per device; later ones are only counted (a device can loop).
MAX_MALFORMED_NOTES = 3


@dataclass
class DeviceProgress:
    """One device's job as seen from the operator side."""

    device: str
    bytes_total: int
    state: JobState | None = None  # None: nothing heard yet
    progress: float | None = None
    bytes_done: int = 0
    #: Chunk bytes this deploy's server sent to the device (finer-grained than the job's progress).
    served: int = 0
    error_code: str | None = None
    error: str | None = None
    history: list[JobState] = field(default_factory=list)
    online: bool | None = None  # None: no retained status seen
    timings_s: dict[str, float] = field(default_factory=dict)
    effective: dict[str, Any] | None = None
    updated: float = field(default_factory=time.monotonic)
    #: Messages from this device that did not parse, and the first few of them, described.
    malformed: int = 0
    malformed_notes: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """True once the job reached a terminal state."""
        return self.state is not None and self.state.terminal

    @property
    def ok(self) -> bool:
        """True when the job ended ACTIVE."""
        return self.state is JobState.ACTIVE

    @property
    def fraction(self) -> float:
        """How far the job is, 0..1: download bytes (reported or served), 1 once downloaded."""
        if self.state in (None, JobState.QUEUED):
            return 0.0
        if self.state is JobState.DOWNLOADING:
            done = max(self.bytes_done, min(self.served, self.bytes_total))
            return min(1.0, done / self.bytes_total) if self.bytes_total else 0.0
        return 1.0 if self.ok or not self.done else min(1.0, self.bytes_done / (self.bytes_total or 1))

    def copy(self) -> DeviceProgress:
        return replace(
            self,
            history=list(self.history),
            timings_s=dict(self.timings_s),
            malformed_notes=list(self.malformed_notes),
        )


@dataclass(frozen=True)
class DeployOutcome:
    """How a deploy ended, per device."""

    job_id: str
    sequence: int
    devices: dict[str, DeviceProgress]

    @property
    def ok(self) -> bool:
        """True when every device ended ACTIVE."""
        return all(p.ok for p in self.devices.values())

    @property
    def finished(self) -> bool:
        """True when every device reached a terminal state."""
        return all(p.done for p in self.devices.values())

    @property
    def malformed(self) -> bool:
        """True when some device sent a message about this deploy that did not parse."""
        return any(p.malformed for p in self.devices.values())

    def malformed_lines(self) -> list[str]:
        """One line per malformed message kept: the device, which message, which field and why.

        Device text in them is not yet made safe for a terminal (see agent.fleet.untrusted).
        """
        lines: list[str] = []
        for name, p in sorted(self.devices.items()):
            lines.extend(f"{name}: malformed {note}" for note in p.malformed_notes)
            if p.malformed > len(p.malformed_notes):
                lines.append(f"{name}: {p.malformed - len(p.malformed_notes)} more malformed message(s)")
        return lines

    def failures(self) -> list[str]:
        """One line per device that did not end ACTIVE: state, error code and message."""
        lines = []
        for name, p in sorted(self.devices.items()):
            if p.ok:
                continue
            if p.state is None:
                seen = "offline" if p.online is False else "no job status received"
                lines.append(f"{name}: no final state ({seen}); the manifest stays retained for it")
            elif not p.done:
                lines.append(f"{name}: still {p.state.value} when the deploy stopped waiting")
            else:
                lines.append(f"{name}: {p.state.value} {p.error_code or ''}: {p.error or ''}".rstrip(": "))
        return lines
