"""The agent's own ``/metrics`` (opt-in: ``telemetry.prometheus.port``), for sites that scrape devices.

It serves the figures of the latest ``up/telemetry`` message, named as :mod:`agent.telemetry.series`
says (the same names the controller's fleet-wide ``/metrics`` uses, there with a ``device`` label).
Serving the last message, rather than reading the registry at scrape time, keeps a scrape from
moving the rate meters' and CPU percentages' baselines (both measure "since the previous read"),
so ``/metrics`` and ``up/telemetry`` never disagree. Figures older than ``stale_after_s`` (the
telemetry loop stopped) are left out, so Prometheus marks them stale instead of charting a frozen
value; ``edge_telemetry_last_timestamp_seconds`` stays.

``prometheus_client`` is imported here only, and only when the endpoint starts: a device that does
not enable it needs none of it (``pip install 'edge-agent[metrics]'`` for one that does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import structlog

from agent.errors import ConfigError
from agent.telemetry.series import Family, gather

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = structlog.get_logger(__name__)


def to_metrics(families: Iterable[Family]) -> list[Metric]:
    """prometheus_client metric families of ``families`` (gauges and counters)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: list[Metric] = []
    for family in families:
        metric: GaugeMetricFamily | CounterMetricFamily
        if family.kind == "counter":
            # prometheus_client appends "_total" to a counter's name itself.
            metric = CounterMetricFamily(
                family.name.removesuffix("_total"), family.help, labels=family.label_names
            )
        else:
            metric = GaugeMetricFamily(family.name, family.help, labels=family.label_names)
        for values, value in family.samples:
            metric.add_metric(list(values), value)
        out.append(metric)
    return out


class TelemetryEndpoint:
    """An HTTP server on ``host:port`` whose ``/metrics`` shows the latest telemetry figures."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        stale_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._figures: dict[str, float] = {}
        self._at: float | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def update(self, figures: dict[str, float]) -> None:
        """Take one telemetry message (``ts`` is dropped: the arrival time is kept instead)."""
        kept = {k: v for k, v in figures.items() if k != "ts"}
        with self._lock:
            self._figures, self._at = kept, self._clock()

    def collect(self) -> list[Metric]:
        """The exposition's families (what a scrape returns); prometheus_client calls it per scrape."""
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            figures, at = self._figures, self._at
        if at is None:
            return []
        last = GaugeMetricFamily(
            "edge_telemetry_last_timestamp_seconds", "When the agent built its latest telemetry message."
        )
        last.add_metric([], at)
        if self._clock() - at > self.stale_after_s:
            return [last]
        families: dict[str, Family] = {}
        gather(families, figures)
        return [last, *to_metrics(families.values())]

    @property
    def port(self) -> int:
        """The port it listens on (the requested one, or the one the OS gave for port 0)."""
        if self._server is None:
            raise RuntimeError("TelemetryEndpoint.port before start()")
        return int(self._server.server_port)

    def start(self) -> None:
        """Bind and serve in a daemon thread; ConfigError: the port is taken, or no prometheus_client."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as exc:
            raise ConfigError(
                "telemetry.prometheus.port is set but prometheus_client is not installed: "
                "pip install 'edge-agent[metrics]' (or unset telemetry.prometheus.port)"
            ) from exc
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # a Collector is any object with collect()
        try:
            self._server, self._thread = start_http_server(self.requested_port, self.host, registry)
        except OSError as exc:
            where = f"{self.host}:{self.requested_port}"
            raise ConfigError(
                f"telemetry.prometheus: cannot listen on {where}: {exc.strerror or exc}"
            ) from exc
        log.info("telemetry.prometheus.started", host=self.host, port=self.port)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._server = None
        log.info("telemetry.prometheus.stopped")
