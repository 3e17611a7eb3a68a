"""The agent's own opt-in /metrics: the real telemetry loop feeds it, an HTTP GET reads it back."""

from __future__ import annotations

import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.config.models import TelemetryConfig
from agent.errors import ConfigError
from agent.telemetry import DeviceStats, Metrics, TelemetryLoop
from agent.telemetry.prometheus import TelemetryEndpoint
from agent.telemetry.series import series_of
from tests.waiting import patient, wait_until


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=patient(10)) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fake_sysfs(root: Path) -> Path:
    """A thermal zone as a Jetson has one (the real sysfs of this machine has none to read)."""
    zone = root / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("CPU-therm\n")
    (zone / "temp").write_text("48500\n")
    return root


def test_the_telemetry_loop_s_figures_are_served_as_metrics(tmp_path: Path) -> None:
    metrics = Metrics()
    published = metrics.counter("stream.cam0.frames_published")
    metrics.rate("stream.cam0.fps", "stream.cam0.frames_published")
    metrics.counter("stream.cam0.dropped.queue_full").inc(2)
    metrics.histogram("stream.cam0.latency.total").observe(0.010)
    published.inc(42)
    endpoint = TelemetryEndpoint("127.0.0.1", 0, stale_after_s=60)
    endpoint.start()
    stop = threading.Event()
    sent: list[dict[str, float]] = []

    def publish(values: dict[str, float]) -> None:
        endpoint.update(values)
        sent.append(values)

    loop = TelemetryLoop(metrics, DeviceStats(fake_sysfs(tmp_path)), publish, 0.2, stop)
    loop.start()
    try:
        wait_until(lambda: bool(sent), what="one telemetry message")
        got = scrape(endpoint.port)
    finally:
        stop.set()
        loop.join(patient(5))
        endpoint.stop()
    assert got[("edge_stream_frames_total", frozenset({("stream", "cam0"), ("stage", "published")}))] == 42
    assert (
        got[("edge_stream_dropped_frames_total", frozenset({("stream", "cam0"), ("reason", "queue_full")}))]
        == 2
    )
    p99 = got[
        (
            "edge_stream_latency_seconds",
            frozenset({("stream", "cam0"), ("stage", "total"), ("quantile", "0.99")}),
        )
    ]
    assert p99 == pytest.approx(0.010)
    assert got[("edge_temperature_celsius", frozenset({("zone", "cpu_therm")}))] == 48.5
    rss = got[("edge_process_resident_memory_bytes", frozenset())]
    assert rss == pytest.approx(sent[-1]["process.rss_mb"] * 1024 * 1024)
    assert ("edge_telemetry_last_timestamp_seconds", frozenset()) in got


def test_figures_older_than_stale_after_s_are_left_out() -> None:
    now = [1000.0]
    endpoint = TelemetryEndpoint("127.0.0.1", 0, stale_after_s=30, clock=lambda: now[0])
    endpoint.start()
    try:
        assert scrape(endpoint.port) == {}  # nothing built yet
        endpoint.update({"ts": 1.0, "cpu.percent": 12.0})
        assert scrape(endpoint.port)[("edge_cpu_percent", frozenset())] == 12.0
        now[0] += 31
        assert scrape(endpoint.port) == {("edge_telemetry_last_timestamp_seconds", frozenset()): 1000.0}
    finally:
        endpoint.stop()


def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = TelemetryEndpoint("127.0.0.1", taken.getsockname()[1], stale_after_s=30)
        with pytest.raises(ConfigError, match=r"telemetry\.prometheus: cannot listen on 127\.0\.0\.1:"):
            endpoint.start()


def test_the_metrics_section_of_the_operations_doc_says_what_the_code_does() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text(encoding="utf-8")
    section = doc.split("## Metrics and dashboards", 1)[1].split("\n## ", 1)[0]
    # The device's opt-in endpoint, as documented, is a valid telemetry section.
    snippet = section.split("```yaml\ntelemetry:\n", 1)[1].split("```", 1)[0]
    config = TelemetryConfig.model_validate(yaml.safe_load("telemetry:\n" + snippet)["telemetry"])
    assert (config.prometheus.port, config.prometheus.host) == (9108, "0.0.0.0")
    assert TelemetryConfig().prometheus.host == "127.0.0.1"
    # The renamings it quotes.
    p99 = series_of("stream.cam0.latency.total.p99_ms")
    assert p99 is not None
    assert (p99.metric, dict(p99.labels)) == (
        "edge_stream_latency_seconds",
        {"stream": "cam0", "stage": "total", "quantile": "0.99"},
    )
    prose = " ".join(section.split())  # the doc wraps lines anywhere
    assert 'stream="cam0", stage="total", quantile="0.99"' in prose
    for field, metric in (
        ("process.rss_mb", "edge_process_resident_memory_bytes"),
        ("temp.cpu_therm_c", "edge_temperature_celsius"),
    ):
        found = series_of(field)
        assert found is not None
        assert found.metric == metric
        assert f"`{field}` becomes `{metric}" in prose


def test_the_certificate_figures_become_a_days_gauge_and_renewal_counters() -> None:
    days = series_of("cert.days_to_expiry")
    assert days is not None
    assert (days.metric, days.kind, days.labels) == ("edge_certificate_days_to_expiry", "gauge", ())
    renewed = series_of("cert.renewed")
    assert renewed is not None
    assert (renewed.metric, renewed.kind, dict(renewed.labels)) == (
        "edge_certificate_renewal_events_total",
        "counter",
        {"event": "renewed"},
    )
