"""The metrics registry: counters, gauges, histograms, rates, collectors and the flat snapshot."""

from __future__ import annotations

import threading

import pytest
from structlog.testing import capture_logs

from agent.telemetry import Counter, Histogram, Metrics, RateMeter
from tests.waiting import patient


def test_counter_is_exact_under_concurrent_increments() -> None:
    counter = Counter("stream.cam0.frames_captured")
    per_thread = 20_000

    def work() -> None:
        for _ in range(per_thread):
            counter.inc()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=patient(60))
    counter.inc(5)
    assert counter.value == 4 * per_thread + 5


def test_get_or_create_returns_the_same_object() -> None:
    m = Metrics()
    assert m.counter("a.b") is m.counter("a.b")
    assert m.gauge("a.c") is m.gauge("a.c")
    assert m.histogram("a.d") is m.histogram("a.d")


def test_one_name_has_one_kind() -> None:
    m = Metrics()
    m.counter("stream.cam0.frames")
    with pytest.raises(TypeError, match="is a Counter, not a Gauge"):
        m.gauge("stream.cam0.frames")


@pytest.mark.parametrize("bad", ["", ".a", "a.", "a..b", "a b", "a/b", "é"])
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        Metrics().counter(bad)


def test_histogram_percentiles_are_milliseconds() -> None:
    h = Histogram("stage.infer.latency")
    for ms in range(1, 101):  # 1..100 ms
        h.observe(ms / 1000)
    p = h.percentiles()
    assert set(p) == {"p50", "p95", "p99"}
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert h.count == 100


def test_histogram_window_keeps_only_recent_samples() -> None:
    h = Histogram("stage.infer.latency", window=16)
    for _ in range(100):
        h.observe(1.0)  # an old, slow model
    for _ in range(16):
        h.observe(0.002)  # after the swap
    assert h.percentiles()["p99"] == pytest.approx(2.0)
    assert h.count == 116


def test_empty_histogram_reports_only_its_count() -> None:
    m = Metrics()
    m.histogram("stage.publish.latency")
    assert m.histogram("stage.publish.latency").percentiles() == {}
    assert m.snapshot() == {"stage.publish.latency.count": 0.0}


def test_snapshot_is_flat_and_numeric() -> None:
    m = Metrics()
    m.counter("stream.cam0.frames_captured").inc(7)
    m.counter("stream.cam0.dropped.queue_full").inc()
    m.gauge("slot.default.version").set(3)
    h = m.histogram("stage.infer.latency")
    h.observe(0.010)
    h.observe(0.020)
    snap = m.snapshot()
    assert snap["stream.cam0.frames_captured"] == 7.0
    assert snap["stream.cam0.dropped.queue_full"] == 1.0
    assert snap["slot.default.version"] == 3.0
    assert snap["stage.infer.latency.count"] == 2.0
    assert snap["stage.infer.latency.p50_ms"] == pytest.approx(15.0)
    assert snap["stage.infer.latency.p95_ms"] == pytest.approx(19.5)
    assert snap["stage.infer.latency.p99_ms"] == pytest.approx(19.9)
    assert all(isinstance(v, float) for v in snap.values())


def test_collectors_are_prefixed_and_failures_skipped() -> None:
    m = Metrics()
    m.add_collector(lambda: {"depth": 3, "capacity": 8}, prefix="stream.cam0.queue")
    m.add_collector(lambda: {"mqtt.connected": True})
    m.add_collector(lambda: {"queue.depth": 2}, prefix="slot.default.")  # trailing dot: same as without

    def broken() -> dict[str, float]:
        raise RuntimeError("link object gone")

    m.add_collector(broken, prefix="broken")
    m.add_collector(lambda: {"ok": 1.0, "nan": float("nan"), "text": "x"}, prefix="mixed")  # type: ignore[dict-item]
    with capture_logs() as logs:
        snap = m.snapshot()
    assert snap == {
        "stream.cam0.queue.depth": 3.0,
        "stream.cam0.queue.capacity": 8.0,
        "mqtt.connected": 1.0,
        "slot.default.queue.depth": 2.0,
        "mixed.ok": 1.0,
    }
    events = [e["event"] for e in logs]
    assert "telemetry.collector.failed" in events
    assert "telemetry.collector.not_numeric" in events


def test_removed_collector_is_no_longer_called() -> None:
    m = Metrics()
    remove = m.add_collector(lambda: {"depth": 1}, prefix="q")
    assert m.snapshot() == {"q.depth": 1.0}
    remove()
    remove()  # idempotent
    assert m.snapshot() == {}


def test_forget_drops_one_stream() -> None:
    m = Metrics()
    m.counter("stream.cam0.frames").inc()
    m.counter("stream.cam01.frames").inc()
    m.gauge("stream.cam0").set(1)
    m.forget("stream.cam0")
    assert m.snapshot() == {"stream.cam01.frames": 1.0}


def test_rate_meter_reports_increase_per_second() -> None:
    counter = Counter("stream.cam0.frames_inferred")
    meter = RateMeter("stream.cam0.fps", counter)
    t0 = meter._last_t
    counter.inc(50)
    assert meter.sample(now=t0 + 2.0) == pytest.approx(25.0)
    counter.inc(30)
    assert meter.sample(now=t0 + 3.0) == pytest.approx(30.0)
    # A sample right after the previous one repeats the rate and keeps the baseline.
    counter.inc(100)
    assert meter.sample(now=t0 + 3.1) == pytest.approx(30.0)
    assert meter.sample(now=t0 + 4.0) == pytest.approx(100.0)
    assert meter.sample(now=t0 + 5.0) == 0.0


def test_snapshot_computes_registered_rates() -> None:
    m = Metrics()
    meter = m.rate("stream.cam0.fps", "stream.cam0.frames_inferred")
    meter.min_interval_s = 0.0
    m.counter("stream.cam0.frames_inferred").inc(10)
    first = m.snapshot()
    assert first["stream.cam0.fps"] > 0.0
    assert first["stream.cam0.frames_inferred"] == 10.0
    assert m.snapshot()["stream.cam0.fps"] == 0.0  # nothing new since the last snapshot
