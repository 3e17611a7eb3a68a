"""When the next scrape of ``/metrics`` is due, from the times of the last ones.

Prometheus scrapes a target at a fixed interval, so after two equal intervals the next scrape is
due one interval after the last: the controller builds its answer just before then, and the scrape
finds it ready (:class:`agent.fleet.metrics.exposition.FleetMetrics`). Scrapes that keep no
interval (two Prometheus servers at different offsets, a person with curl) or that come faster
than :data:`MIN_PERIOD_S` (a test polling) predict nothing: those scrapes build their own answer.
"""

from __future__ import annotations

from collections import deque

#: Shortest interval taken as a scraper's period (faster pollers build their own answers).
MIN_PERIOD_S = 2.0
#: How far two intervals may differ, as a share of the last, and still be one period.
PERIOD_TOLERANCE = 0.1


class ScrapeCadence:
    """The times of the last three scrapes and the next one they predict."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=3)

    def scraped(self, at: float) -> None:
        """A scrape came at ``at`` (seconds on a monotonic clock)."""
        self._times.append(at)

    @property
    def last(self) -> float | None:
        """When the last scrape came, or None before the first."""
        return self._times[-1] if self._times else None

    def next_due(self) -> float | None:
        """When the next scrape is due, or None when the last ones kept no period."""
        if len(self._times) < 3:
            return None
        first, second, last = self._times
        period = last - second
        if period < MIN_PERIOD_S or abs((second - first) - period) > PERIOD_TOLERANCE * period:
            return None
        return last + period
