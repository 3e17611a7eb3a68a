"""The device page's charts over time, kept small: a fixed number of figures per telemetry sample.

A device's ``up/telemetry`` may carry hundreds of figures (and a hostile one megabytes of them);
the charts draw four. So the history keeps, per sample, only the arrival time and those four
(:data:`CHARTED`), as doubles in one flat :class:`array.array`: 40 bytes a point whatever the
message carried, a missing figure stored as NaN. The latest sample's every figure is kept
elsewhere (the fleet view's ``telemetry``), once, not once per point.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass

#: The charted figures of a sample, in storage order (docs/console.md, the device page).
CHARTED = ("fps", "p50_ms", "p99_ms", "temp_c")
_WIDTH = 1 + len(CHARTED)  # the arrival time, then the charted figures
#: Bytes a point takes in the array (a double each).
POINT_BYTES = 8 * _WIDTH


@dataclass(frozen=True)
class TelemetryPoint:
    """One ``up/telemetry`` sample: when it arrived (controller clock) and its charted figures."""

    ts: float
    figures: dict[str, float | None]  # the names of CHARTED; None: the sample had no such figure


def _largest(figures: Mapping[str, float], prefix: str, suffix: str) -> float | None:
    values = [v for k, v in figures.items() if k.startswith(prefix) and k.endswith(suffix)]
    return max(values) if values else None


def chart_figures(figures: Mapping[str, float]) -> dict[str, float | None]:
    """The charted figures of one telemetry sample (field names: docs/operations.md "Telemetry").

    ``fps``: the streams' published frames per second, summed; ``p50_ms``/``p99_ms``: the slowest
    stream's end-to-end latency percentiles; ``temp_c``: the hottest thermal zone.
    """
    fps = [v for k, v in figures.items() if k.startswith("stream.") and k.endswith(".fps")]
    return {
        "fps": sum(fps) if fps else None,
        "p50_ms": _largest(figures, "stream.", ".latency.total.p50_ms"),
        "p99_ms": _largest(figures, "stream.", ".latency.total.p99_ms"),
        "temp_c": _largest(figures, "temp.", "_c"),
    }


class ChartHistory:
    """At most ``max_points`` samples, oldest first (not thread-safe: the fleet view locks it).

    Memory: at most ``1.25 * max_points * POINT_BYTES`` bytes of array (dropped points are
    compacted away once a quarter of the array is dead), plus the array object itself.
    """

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self._data = array("d")
        self._start = 0  # points before this index are dropped (compacted away in batches)

    def __len__(self) -> int:
        return len(self._data) // _WIDTH - self._start

    @property
    def nbytes(self) -> int:
        """Bytes of the array's items (what a point costs, times the points held, dead ones too)."""
        return len(self._data) * self._data.itemsize

    def add(self, ts: float, figures: Mapping[str, float]) -> None:
        """Keep the sample that arrived at ``ts``; the oldest goes once there are ``max_points``."""
        charted = chart_figures(figures)
        self._data.append(ts)
        for name in CHARTED:
            value = charted[name]
            self._data.append(math.nan if value is None else value)
        if len(self) > self.max_points:
            self._start += 1
        self._compact()

    def drop_before(self, ts: float) -> None:
        """Forget the points that arrived before ``ts``."""
        while len(self) and self._data[self._start * _WIDTH] < ts:
            self._start += 1
        self._compact()

    def points(self, since: float) -> list[TelemetryPoint]:
        """The points that arrived at ``since`` or later, oldest first."""
        out = []
        for i in range(self._start, len(self._data) // _WIDTH):
            at = i * _WIDTH
            if self._data[at] < since:
                continue
            values = self._data[at + 1 : at + _WIDTH]
            out.append(
                TelemetryPoint(
                    self._data[at],
                    {name: None if math.isnan(v) else v for name, v in zip(CHARTED, values, strict=True)},
                )
            )
        return out

    def _compact(self) -> None:
        if self._start and (self._start * 4 >= self.max_points or not len(self)):
            del self._data[: self._start * _WIDTH]
            self._start = 0
