"""Where a deploy stands and how it ended, per device, with the lines an operator reads about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from agent.protocol.messages import BuildProgressInfo, JobState, ProbationFigures, RunsInfo, ShadowFigures

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
    #: Chunk bytes this deploy's server sent to the device. Not progress (other servers and the
    #: HTTP source send bytes too; the device's own ``bytes_done`` is the progress): it is what
    #: shows that another chunk server answers this device while ``--max-rate`` is meant to hold.
    served: int = 0
    #: The first non-zero ``bytes_done`` the device reported in this deploy (what it already had
    #: when it resumed, or the first tenth): growth beyond it is compared with ``served``.
    bytes_baseline: int | None = None
    #: Bytes the device reported receiving that this deploy's server never sent (0: none seen).
    foreign_bytes: int = 0
    #: No retained ``up/status`` when the deploy started: the id never connected to this broker
    #: (or is misspelt). Without ``wait_unknown`` nothing is published to it and nothing awaited.
    unknown: bool = False
    #: The deploy does not wait for this device (an unknown device it was not asked to wait for).
    skipped: bool = False
    error_code: str | None = None
    error: str | None = None
    history: list[JobState] = field(default_factory=list)
    online: bool | None = None  # None: no retained status seen
    timings_s: dict[str, float] = field(default_factory=dict)
    effective: dict[str, Any] | None = None
    #: The job's shadow and probation figures, once it reported them (a rollout's gate reads them).
    shadow: ShadowFigures | None = None
    probation: ProbationFigures | None = None
    #: The engine build's phase, elapsed and estimate while the job is BUILDING (None otherwise).
    build: BuildProgressInfo | None = None
    #: What its job says it runs once the engine is built (precision asked and running, fallback).
    runs: RunsInfo | None = None
    updated: float = field(default_factory=time.monotonic)
    #: When (time.monotonic) the job entered its current state: a long phase (shadow, probation)
    #: shows how long it has run and how long is left.
    state_since: float = field(default_factory=time.monotonic)
    #: Messages from this device that did not parse, and the first few of them, described.
    malformed: int = 0
    malformed_notes: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """True once the job reached a terminal state, or the deploy does not wait for the device."""
        return self.skipped or self.ended

    @property
    def ended(self) -> bool:
        """True once the job reached a terminal state (ACTIVE or a failure end)."""
        return self.state is not None and self.state.terminal

    @property
    def failed(self) -> bool:
        """True when the job ended in a state other than ACTIVE."""
        return self.ended and not self.ok

    @property
    def ok(self) -> bool:
        """True when the job ended ACTIVE."""
        return self.state is JobState.ACTIVE

    @property
    def fraction(self) -> float:
        """How far the job is, 0..1, as the device reports it: its downloaded bytes, 1 once downloaded.

        Only the device knows what it has: bytes this deploy served may be lost, duplicated or
        joined by another server's, so they never count here.
        """
        if self.state in (None, JobState.QUEUED):
            return 0.0
        if self.state is JobState.DOWNLOADING:
            return min(1.0, self.bytes_done / self.bytes_total) if self.bytes_total else 0.0
        return 1.0 if self.ok or not self.ended else min(1.0, self.bytes_done / (self.bytes_total or 1))

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
    def skipped(self) -> list[str]:
        """Devices the deploy did not wait for: no retained status, and not asked to wait for them."""
        return sorted(name for name, p in self.devices.items() if p.skipped)

    @property
    def failed(self) -> bool:
        """True when some device's job ended in a state other than ACTIVE."""
        return any(p.failed for p in self.devices.values())

    def rate_cap_lines(self) -> list[str]:
        """One line per device that received chunk bytes this deploy's server did not send."""
        return [
            f"{name}: received {p.foreign_bytes} bytes this deploy did not send: another chunk server "
            "(a `fleet serve`) answers its requests, so --max-rate did not hold for it"
            for name, p in sorted(self.devices.items())
            if p.foreign_bytes
        ]

    @property
    def malformed(self) -> bool:
        """True when some device sent a message about this deploy that did not parse."""
        return any(p.malformed for p in self.devices.values())

    def malformed_lines(self) -> list[str]:
        """One line per malformed message kept: the device, which message, which field and why.

        Device text in them is not yet made safe for a terminal (see agent.fleet.base.untrusted).
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
            if p.skipped:
                lines.append(
                    f"{name}: unknown device: no retained status (it never connected to this broker "
                    "under this prefix, or the id is misspelt); nothing was published to it "
                    "(--wait-unknown publishes and waits for it)"
                )
            elif p.state is None:
                seen = "offline" if p.online is False else "no job status received"
                lines.append(f"{name}: no final state ({seen}); the manifest stays retained for it")
            elif not p.ended:
                lines.append(f"{name}: still {p.state.value} when the deploy stopped waiting")
            else:
                lines.append(f"{name}: {p.state.value} {p.error_code or ''}: {p.error or ''}".rstrip(": "))
        return lines
