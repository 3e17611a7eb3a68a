"""The live per-device progress of ``fleet deploy``: redrawn in place on a terminal, one line per
change otherwise (a log file or CI output stays readable).

Error codes and texts come from the devices: they pass through :func:`~agent.fleet.base.untrusted.shown`,
so no device can move the cursor or draw a line of its own, and each fits its column.

Also the one-line texts the fleet commands print about a manifest and a byte count.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from agent.fleet.base.untrusted import shown
from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.rollout.waves import format_duration
from agent.fleet.view.build_note import build_note
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState

#: Longest error message shown in the live line (the final summary shows more of it).
_ERROR_WIDTH = 60
#: Job states that last long (a minute of probation): their lines show the time run and left.
LONG_PHASES = frozenset({JobState.SHADOW, JobState.PROBATION})
#: How often a non-terminal view prints a line for a device in a long phase (shadow, probation).
_PHASE_LINE_S = 10.0
#: Longest error code shown (codes are short words; a device can send anything).
_CODE_WIDTH = 32


def passed_states(p: DeviceProgress, shown: int) -> list[JobState]:
    """States the job went through after the first ``shown`` and before its current one.

    Snapshots are taken per poll, so a job can pass several states between two of them.
    """
    return p.history[shown:-1] if len(p.history) > shown else []


def state_line(p: DeviceProgress, state: JobState, width: int = 0) -> str:
    """``device  STATE`` for a state the job passed through (no progress figures: they are gone)."""
    return f"{shown(p.device):<{width}}  {state.value}"


def phase_note(p: DeviceProgress, now: float, probation_s: float | None = None) -> str:
    """How long a long phase has run and, for probation, how long is left, so that a long
    PROBATION is not one unchanging line. ``now`` is ``time.monotonic()``; the probation's length is
    the device's own figure once it reported one, else ``probation_s`` (the manifest's)."""
    if p.state not in LONG_PHASES:
        return ""
    elapsed = max(0.0, now - p.state_since)
    if p.state is JobState.SHADOW:
        return f"shadow {format_duration(elapsed)}"
    total = p.probation.probation_s if p.probation is not None else probation_s
    if total is None:
        return f"probation {format_duration(elapsed)}"
    ran = f"probation {format_duration(elapsed)} of {format_duration(total)}"
    return f"{ran}, ending" if elapsed >= total else f"{ran}, {format_duration(total - elapsed)} left"


def progress_line(
    p: DeviceProgress, width: int = 0, *, now: float | None = None, probation_s: float | None = None
) -> str:
    """``device  STATE  pct  done/total  note`` for one device; figures as the device reported them."""
    if p.skipped:
        note = "(no retained status: not deployed to, not waited for)"
        return f"{shown(p.device):<{width}}  {'unknown':<11} {note}"
    state = p.state.value if p.state is not None else "waiting"
    pct = f"{p.fraction * 100:3.0f}%"
    if p.state is None or p.state is JobState.QUEUED:
        done = 0
    elif p.state is JobState.DOWNLOADING:
        done = p.bytes_done
    else:
        done = p.bytes_total if p.ok or not p.ended else p.bytes_done
    line = (
        f"{shown(p.device):<{width}}  {state:<11} {pct}  {format_bytes(done)} / {format_bytes(p.bytes_total)}"
    )
    if p.failed:
        line += f"  {shown(p.error_code or '', _CODE_WIDTH)}: {shown(p.error or '', _ERROR_WIDTH)}"
    elif p.ok and p.timings_s:
        line += f"  in {sum(p.timings_s.values()):.1f} s"
        if p.runs is not None and p.runs.fallback:
            # ACTIVE, but not at the precision asked: the device's reason is in `fleet status`.
            line += f"  runs {shown(p.runs.precision or '?', 16)}, {shown(p.runs.requested or '?', 16)} asked"
    elif p.build is not None and p.state is JobState.BUILDING:
        line += f"  {build_note(p.build)}"
    elif note := phase_note(p, time.monotonic() if now is None else now, probation_s):
        line += f"  {note}"
    elif p.unknown and p.state is None:
        line += "  (unknown device: no retained status yet; waiting for it to connect)"
    elif p.online is False:
        line += "  (device offline: waiting for it to connect)"
    if p.foreign_bytes:
        line += "  (another chunk server answers it: --max-rate does not hold)"
    if p.malformed:
        line += f"  ({p.malformed} malformed message(s) from it)"
    return line


class ProgressView:
    """Shows :class:`DeviceProgress` snapshots on ``stream``."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        min_interval_s: float = 0.1,
        probation_s: float | None = None,
    ):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.probation_s = probation_s
        self.min_interval_s = min_interval_s
        self._drawn = 0
        self._last_draw = 0.0
        self._last_lines: dict[str, str] = {}
        self._last_keys: dict[str, tuple[object, ...]] = {}
        self._shown: dict[str, int] = {}  # history entries already printed, per device

    def update(self, devices: Sequence[DeviceProgress], *, force: bool = False) -> None:
        """Show the new state: redraw (terminal, rate-limited) or print the lines that changed."""
        width = max((len(shown(p.device)) for p in devices), default=0)
        if self.tty:
            now = time.monotonic()
            if not force and now - self._last_draw < self.min_interval_s:
                return
            self._last_draw = now
            self._redraw([progress_line(p, width, probation_s=self.probation_s) for p in devices])
            return
        for p in devices:
            for state in passed_states(p, self._shown.get(p.device, 0)):
                self.stream.write(state_line(p, state, width) + "\n")
            self._shown[p.device] = len(p.history)
            # A new line only for a new state, another tenth or a new note.
            key = (
                p.state,
                int(p.fraction * 10),
                p.error_code,
                p.online is False,
                p.malformed,
                p.unknown,
                p.skipped,
                p.foreign_bytes > 0,
                # a long phase: a line every _PHASE_LINE_S, so a log shows it is still going
                int((time.monotonic() - p.state_since) // _PHASE_LINE_S) if p.state in LONG_PHASES else 0,
            )
            if self._last_keys.get(p.device) != key:
                self._last_keys[p.device] = key
                self.stream.write(progress_line(p, width, probation_s=self.probation_s) + "\n")
        self.stream.flush()

    def say(self, text: str, stream: TextIO | None = None) -> None:
        """Print a line of the command's own (``deploy: ...``) below the progress: a progress line
        drawn without its newline is ended first (no text glued to a progress line), and
        the next redraw starts a fresh block under the text rather than overwriting it."""
        if self.tty and self._drawn:
            if self._drawn == 1 and "" in self._last_lines:
                self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
            self._last_lines.clear()
        out = stream if stream is not None else self.stream
        out.write(text + "\n")
        out.flush()

    def _redraw(self, lines: list[str]) -> None:
        out = self.stream
        if len(lines) == 1 and self._drawn <= 1:
            previous = self._last_lines.get("", "")
            out.write("\r" + lines[0] + " " * max(0, len(previous) - len(lines[0])))
            self._last_lines[""] = lines[0]
            self._drawn = 1
        else:
            if self._drawn > 1:
                out.write(f"\x1b[{self._drawn}F")  # back to the first line drawn
            elif self._drawn == 1:
                out.write("\r")
            for line in lines:
                out.write("\x1b[2K" + line + "\n")
            self._drawn = len(lines)
        out.flush()

    def close(self, devices: Sequence[DeviceProgress]) -> None:
        """Draw the final state and leave the cursor on a fresh line."""
        self.update(devices, force=True)
        if self.tty and len(devices) == 1:
            self.stream.write("\n")
            self.stream.flush()


def describe_manifest(manifest: DeployManifest) -> str:
    """One line: job, sequence, model, size and chunking."""
    return (
        f"job {manifest.job_id} (sequence {manifest.sequence}): {manifest.model_id} v{manifest.version}, "
        f"{format_bytes(manifest.size)}, {manifest.chunk_count} chunks of "
        f"{format_bytes(manifest.chunk_size)}, sha256 {manifest.sha256[:12]}..."
    )


def format_bytes(n: float) -> str:
    """Human-readable byte count: ``812 B``, ``25.1 KiB``, ``3.4 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
