"""The metrics registry: counters, gauges, latency histograms, rates and snapshot-time collectors.

Names are dotted (``stream.cam0.frames_captured``, ``stage.infer.latency``) and become the keys of
the flat JSON published on ``up/telemetry``.

The per-frame path is cheap: look a metric up once (``metrics.counter(name)``), keep the object,
and call ``inc``/``set``/``observe`` on it; each is a handful of bytecodes under a per-metric lock
(or none, for gauges). All arithmetic that costs something (percentiles, rates, collectors) runs
at snapshot time, once per telemetry interval, on the telemetry thread.

Rates (frames per second and the like) are derived from counters: ``metrics.rate("stream.cam0.fps",
"stream.cam0.frames_inferred")`` registers a :class:`RateMeter`, and every :meth:`Metrics.snapshot`
reports the counter's increase per second since the previous snapshot. So the rate covers exactly
one telemetry interval, and the counter stays a plain monotonic total that dashboards can also
differentiate themselves.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np
import structlog

log = structlog.get_logger(__name__)

#: Dotted metric names: they become JSON keys and Telegraf/Influx field names.
METRIC_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

#: Percentiles reported by every histogram, as (key, percentile).
PERCENTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))

Collector = Callable[[], Mapping[str, float]]


def _check_name(name: str) -> str:
    if not METRIC_NAME.match(name) or ".." in name or name.endswith("."):
        raise ValueError(f"invalid metric name {name!r}: use dotted words of letters, digits, '_' and '-'")
    return name


class Counter:
    """A monotonically increasing total (frames captured, frames dropped, bytes sent)."""

    __slots__ = ("_lock", "_value", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._value = 0
        # ``+=`` on an attribute is not atomic across threads, and several stages count per frame.
        self._lock = threading.Lock()

    def inc(self, n: int = 1) -> None:
        """Add ``n`` (default 1)."""
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        """The total so far."""
        return self._value


class Gauge:
    """A value that goes up and down (queue depth, active model version, link up 0/1)."""

    __slots__ = ("_value", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._value = 0.0

    def set(self, v: float) -> None:
        """Replace the value (a single attribute store: atomic, so no lock)."""
        self._value = float(v)

    @property
    def value(self) -> float:
        """The last value set (0.0 before the first ``set``)."""
        return self._value


class Histogram:
    """Latency samples in seconds; reports p50/p95/p99 in milliseconds over the latest ``window`` samples.

    Samples go into a preallocated numpy ring buffer, so ``observe`` never allocates; percentiles
    are computed only when asked (at snapshot time). A sliding window of recent samples, rather
    than buckets since start, makes a latency regression after a model swap visible at once.
    """

    __slots__ = ("_count", "_lock", "_ring", "name", "window")

    def __init__(self, name: str, window: int = 2048) -> None:
        if window < 1:
            raise ValueError(f"histogram {name!r}: window must be >= 1, got {window}")
        self.name = name
        self.window = window
        self._ring = np.zeros(window, dtype=np.float64)
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Record one duration in seconds (e.g. ``time.perf_counter()`` differences)."""
        with self._lock:
            self._ring[self._count % self.window] = seconds
            self._count += 1

    @property
    def count(self) -> int:
        """Total observations since creation (not limited to the window)."""
        return self._count

    def percentiles(self) -> dict[str, float]:
        """``{"p50": ms, "p95": ms, "p99": ms}`` over the window; empty before the first sample."""
        with self._lock:
            filled = min(self._count, self.window)
            # Copy under the lock so observers can keep writing while numpy sorts.
            samples = self._ring[:filled].copy()
        if filled == 0:
            return {}
        values = np.percentile(samples, [q for _, q in PERCENTILES]) * 1000.0
        return {key: float(v) for (key, _), v in zip(PERCENTILES, values, strict=True)}


class RateMeter:
    """A counter's increase per second between consecutive snapshots.

    If two snapshots come closer than ``min_interval_s`` (e.g. a ``status`` command right after the
    telemetry tick), the previous rate is repeated and the baseline kept, so a tiny interval never
    produces a noisy rate and never shortens the telemetry loop's own interval much.
    """

    __slots__ = ("_last_count", "_last_t", "_lock", "_rate", "counter", "min_interval_s", "name")

    def __init__(self, name: str, counter: Counter, min_interval_s: float = 0.5) -> None:
        self.name = name
        self.counter = counter
        self.min_interval_s = min_interval_s
        self._last_t = time.monotonic()
        self._last_count = counter.value
        self._rate = 0.0
        self._lock = threading.Lock()

    def sample(self, now: float | None = None) -> float:
        """The rate since the previous sample (per second); advances the baseline."""
        t = time.monotonic() if now is None else now
        with self._lock:
            dt = t - self._last_t
            if dt < self.min_interval_s:
                return self._rate
            count = self.counter.value
            self._rate = max(0, count - self._last_count) / dt
            self._last_t = t
            self._last_count = count
            return self._rate


Metric = Counter | Gauge | Histogram | RateMeter
M = TypeVar("M", Counter, Gauge, Histogram, RateMeter)


class Metrics:
    """Get-or-create registry of named metrics plus collectors; :meth:`snapshot` flattens it all.

    One name has one kind: asking for ``counter("x")`` after ``gauge("x")`` is a programming error
    and raises ``TypeError``.
    """

    def __init__(self, histogram_window: int = 2048) -> None:
        self.histogram_window = histogram_window
        self._metrics: dict[str, Metric] = {}
        self._collectors: list[tuple[str, Collector]] = []
        self._lock = threading.Lock()

    def counter(self, name: str) -> Counter:
        """The counter called ``name``, created on first use."""
        return self._get(name, Counter, lambda: Counter(name))

    def gauge(self, name: str) -> Gauge:
        """The gauge called ``name``, created on first use."""
        return self._get(name, Gauge, lambda: Gauge(name))

    def histogram(self, name: str) -> Histogram:
        """The latency histogram called ``name`` (seconds in, milliseconds out), created on first use."""
        return self._get(name, Histogram, lambda: Histogram(name, self.histogram_window))

    def rate(self, name: str, counter: str) -> RateMeter:
        """Report ``name`` as the per-second increase of counter ``counter`` between snapshots.

        The counter is created if it does not exist yet, so a stream can register its fps before
        its first frame.
        """
        source = self.counter(counter)
        return self._get(name, RateMeter, lambda: RateMeter(name, source))

    def add_collector(self, fn: Collector, prefix: str = "") -> Callable[[], None]:
        """Call ``fn`` at every snapshot and publish its values under ``prefix.`` (queue depths, link stats).

        Returns a function that removes the collector again (for a stream that goes away on reload).
        A collector that raises is logged (``telemetry.collector.failed``) and skipped for that snapshot.
        """
        prefix = prefix.rstrip(".")  # "slot.a" and "slot.a." mean the same: keys join with one dot
        if prefix:
            _check_name(prefix)
        entry = (prefix, fn)
        with self._lock:
            self._collectors.append(entry)

        def remove() -> None:
            with self._lock:
                if entry in self._collectors:
                    self._collectors.remove(entry)

        return remove

    def forget(self, prefix: str) -> None:
        """Drop every metric named ``prefix`` or ``prefix.*`` (a stream or slot removed on reload)."""
        with self._lock:
            for name in [n for n in self._metrics if n == prefix or n.startswith(prefix + ".")]:
                del self._metrics[name]

    def snapshot(self) -> dict[str, float]:
        """Every metric as one flat ``{name: number}`` dict.

        Counters, gauges and rates by name; histograms as ``<name>.p50_ms``, ``.p95_ms``, ``.p99_ms``
        (omitted until the first sample) and ``<name>.count``; collector values as ``<prefix>.<key>``.
        Non-finite values are dropped: JSON has no NaN, and Telegraf would reject the whole message.
        """
        with self._lock:
            metrics = list(self._metrics.values())
            collectors = list(self._collectors)
        out: dict[str, float] = {}
        now = time.monotonic()
        for m in metrics:
            if isinstance(m, Histogram):
                for key, ms in m.percentiles().items():
                    out[f"{m.name}.{key}_ms"] = ms
                out[f"{m.name}.count"] = float(m.count)
            elif isinstance(m, RateMeter):
                out[m.name] = m.sample(now)
            else:
                out[m.name] = float(m.value)
        for prefix, fn in collectors:
            try:
                values = dict(fn())
            except Exception as exc:  # noqa: BLE001 - one broken collector must not cost the snapshot
                log.warning("telemetry.collector.failed", prefix=prefix, collector=repr(fn), error=repr(exc))
                continue
            for key, value in values.items():
                name = f"{prefix}.{key}" if prefix else key
                try:
                    out[name] = float(value)
                except (TypeError, ValueError):
                    log.warning("telemetry.collector.not_numeric", name=name, value=repr(value))
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def _get(self, name: str, kind: type[M], make: Callable[[], M]) -> M:
        existing = self._metrics.get(name)  # lock-free fast path: dict reads are atomic under the GIL
        if existing is None:
            _check_name(name)
            with self._lock:
                existing = self._metrics.get(name)
                if existing is None:
                    existing = self._metrics[name] = make()
        if not isinstance(existing, kind):
            raise TypeError(
                f"metric {name!r} is a {type(existing).__name__}, not a {kind.__name__}: pick another name"
            )
        return existing
