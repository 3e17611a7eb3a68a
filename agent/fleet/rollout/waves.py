"""The shape of a rollout, from its flags: ``--waves``, ``--max-failed``, ``--soak`` (pure functions).

``--waves 5,10%,50%,100%`` lists where each wave *ends*, cumulatively: the first wave (the canary)
takes the first 5 devices of the selection, the second grows the total to 10 % of it, the third to
50 %, the last to all of it. Items are absolute counts or percentages of the selection; a percentage
rounds up (10 % of 15 devices is 2), so no wave of a non-empty step is empty by rounding. A wave
whose end does not grow the total on this selection (``5,10%`` on 20 devices: 10 % is 2, already
covered) is dropped rather than sent empty, and the last item must cover the whole selection
(``100%``, or a count at least as large), so no device is left out silently.

``--max-failed 2%|3``: how many devices may end badly before the gate trips; a percentage is of the
devices touched so far and rounds *down* (2 % of a 5-device canary allows 0: any failure trips).

``--soak 10m|30s|1h|0``: how long a finished wave is watched before the next one starts.

Every bad value raises one :class:`~agent.errors.UsageError` naming the flag and the item.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import UsageError

_COUNT = re.compile(r"^[0-9]+$")
_PERCENT = re.compile(r"^([0-9]+(?:\.[0-9]+)?)%$")
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(s|m|h)?$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class WaveEnd:
    """Where one wave ends: an absolute device count, or a percentage of the selection."""

    count: int | None = None
    percent: float | None = None

    def devices(self, selection: int) -> int:
        """How many devices of a ``selection`` of this size the waves up to this one cover."""
        if self.count is not None:
            return min(self.count, selection)
        assert self.percent is not None  # one of the two is set by construction
        return min(selection, math.ceil(self.percent * selection / 100.0 - 1e-9))

    def __str__(self) -> str:
        return str(self.count) if self.count is not None else f"{self.percent:g}%"


@dataclass(frozen=True)
class FailureLimit:
    """``--max-failed``: an absolute count, or a percentage of the devices touched so far."""

    count: int | None = None
    percent: float | None = None

    def allowed(self, touched: int) -> int:
        """Devices that may end badly among ``touched`` without tripping the gate."""
        if self.count is not None:
            return self.count
        assert self.percent is not None  # one of the two is set by construction
        # Rounds down: a limit of 2 % must not allow a failure among 5 canaries.
        return math.floor(self.percent * touched / 100.0 + 1e-9)

    def __str__(self) -> str:
        return str(self.count) if self.count is not None else f"{self.percent:g}%"


def _items(flag: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip():
        raise UsageError(f"{flag}: empty; give counts or percentages, e.g. 5,10%,50%,100%")
    for number, item in enumerate(items, 1):
        if not item:
            raise UsageError(f"{flag}: item {number} is empty (two commas in a row, or a trailing comma?)")
    return items


def parse_waves(text: str) -> tuple[WaveEnd, ...]:
    """``--waves``: the cumulative end of each wave; raises :class:`UsageError` naming a bad item."""
    ends: list[WaveEnd] = []
    for number, item in enumerate(_items("--waves", text), 1):
        where = f"--waves: item {number} {item!r}"
        if _COUNT.match(item):
            end = WaveEnd(count=int(item))
            if end.count == 0:
                raise UsageError(f"{where}: a wave needs at least 1 device")
        elif match := _PERCENT.match(item):
            end = WaveEnd(percent=float(match.group(1)))
            if not 0 < float(match.group(1)) <= 100:
                raise UsageError(f"{where}: a percentage must be above 0% and at most 100%")
        else:
            raise UsageError(f"{where}: not a device count (5) or a percentage (10%)")
        for before in ends:
            # Only ends of the same kind compare without knowing the selection's size.
            same_kind = (before.count is None) == (end.count is None)
            if same_kind and (before.count or before.percent or 0) >= (end.count or end.percent or 0):
                raise UsageError(f"{where}: waves are cumulative, so each must end above {before}")
        ends.append(end)
    last = ends[-1]
    if last.percent is not None and last.percent != 100:
        raise UsageError(
            f"--waves: the last item {last} must be 100% so that every selected device is reached"
        )
    return tuple(ends)


def split_waves(devices: Sequence[str], ends: Sequence[WaveEnd]) -> list[list[str]]:
    """Split the ordered ``devices`` into waves (the first is the canary), dropping empty ones.

    Raises :class:`UsageError` when a device appears twice or the last end does not cover them all.
    """
    seen: set[str] = set()
    for device in devices:
        if device in seen:
            raise UsageError(f"device {device!r} is selected twice; a rollout touches each device once")
        seen.add(device)
    if not ends:
        raise UsageError("--waves: no wave given")
    total = len(devices)
    if ends[-1].devices(total) < total:
        raise UsageError(
            f"--waves: the last item {ends[-1]} covers {ends[-1].devices(total)} of the {total} selected "
            "devices; end with 100%"
        )
    waves: list[list[str]] = []
    covered = 0
    for end in ends:
        upto = max(covered, end.devices(total))
        if upto > covered:
            waves.append(list(devices[covered:upto]))
            covered = upto
    return waves


def parse_max_failed(text: str) -> FailureLimit:
    """``--max-failed 2%`` or ``3``; raises :class:`UsageError` naming the value."""
    item = text.strip()
    if _COUNT.match(item):
        return FailureLimit(count=int(item))
    if match := _PERCENT.match(item):
        percent = float(match.group(1))
        if percent > 100:
            raise UsageError(f"--max-failed: {item!r} is above 100%")
        return FailureLimit(percent=percent)
    raise UsageError(f"--max-failed: {text!r} is not a device count (3) or a percentage (2%)")


def parse_duration(text: str, flag: str = "--soak") -> float:
    """``--soak 10m``, ``30s``, ``1h``, ``0`` (a bare number is seconds) -> seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise UsageError(f"{flag}: {text!r} is not a duration; write 30s, 10m or 1h")
    return float(match.group(1)) * _UNIT_S[match.group(2) or "s"]


def format_duration(seconds: float) -> str:
    """A span of time as an operator reads it: ``45 s``, ``4 min 05 s``, ``2 h 10 min`` (to the nearest
    second; never negative)."""
    whole = max(0, int(seconds + 0.5))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
