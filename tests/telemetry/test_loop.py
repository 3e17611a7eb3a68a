"""TelemetryLoop: periodic flat messages, surviving publish failures, prompt stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from structlog.testing import capture_logs

from agent.telemetry import DeviceStats, Metrics, TelemetryLoop
from tests.waiting import patient


class Collected:
    """A publish callable that records messages and can fail the first ``fail_first`` calls."""

    def __init__(self, fail_first: int = 0) -> None:
        self.messages: list[dict[str, float]] = []
        self.calls = 0
        self.fail_first = fail_first
        self._cond = threading.Condition()

    def __call__(self, message: dict[str, float]) -> None:
        with self._cond:
            self.calls += 1
            if self.calls <= self.fail_first:
                self._cond.notify_all()
                raise ConnectionError("broker unreachable")
            self.messages.append(message)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, float]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.messages) >= n, patient(timeout)), (
                f"only {len(self.messages)} of {n} telemetry messages arrived"
            )
            return list(self.messages)


def test_loop_publishes_metrics_and_device_stats() -> None:
    metrics = Metrics()
    metrics.counter("stream.cam0.frames_captured").inc(3)
    metrics.histogram("stage.infer.latency").observe(0.004)
    stop = threading.Event()
    sink = Collected()
    loop = TelemetryLoop(metrics, DeviceStats(Path("/")), sink, interval_s=0.05, stop=stop)
    before = time.time()
    loop.start()
    try:
        messages = sink.wait_for(2)
    finally:
        stop.set()
        assert loop.join(timeout=patient(10))
    first = messages[0]
    assert first["ts"] >= before
    assert messages[1]["ts"] >= first["ts"]
    assert first["stream.cam0.frames_captured"] == 3.0
    assert first["stage.infer.latency.p50_ms"] == 4.0
    assert first["process.rss_mb"] > 0
    assert loop.published == len(sink.messages)


def test_publish_failures_are_logged_and_the_loop_continues() -> None:
    stop = threading.Event()
    sink = Collected(fail_first=2)
    loop = TelemetryLoop(Metrics(), None, sink, interval_s=0.02, stop=stop)
    with capture_logs() as logs:
        loop.start()
        try:
            [message] = sink.wait_for(1)[:1]
        finally:
            stop.set()
            assert loop.join(timeout=patient(10))
    assert set(message) == {"ts"}  # no metrics and no device: just the timestamp
    failures = [e for e in logs if e["event"] == "telemetry.publish.failed"]
    assert len(failures) == 2
    assert "broker unreachable" in failures[0]["error"]


def test_failing_device_collection_is_logged_and_survived() -> None:
    class BrokenDevice(DeviceStats):
        def collect(self) -> dict[str, float]:
            raise OSError("sysfs went away")

    stop = threading.Event()
    sink = Collected()
    metrics = Metrics()
    loop = TelemetryLoop(metrics, BrokenDevice(Path("/")), sink, interval_s=0.02, stop=stop)
    with capture_logs() as logs:
        assert loop.tick() is False
    assert [e["event"] for e in logs] == ["telemetry.collect.failed"]
    assert sink.calls == 0


def test_stop_is_honoured_without_waiting_for_the_interval() -> None:
    stop = threading.Event()
    sink = Collected()
    loop = TelemetryLoop(Metrics(), None, sink, interval_s=3600, stop=stop)
    loop.start()
    stop.set()
    assert loop.join(timeout=patient(10)), "telemetry thread ignored the stop event"
    assert sink.calls == 0
