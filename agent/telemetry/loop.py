"""The telemetry loop: every interval, one flat numeric dict handed to ``publish`` (``up/telemetry``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from agent.telemetry.device import DeviceStats
from agent.telemetry.metrics import Metrics

log = structlog.get_logger(__name__)

Publish = Callable[[dict[str, float]], None]


class TelemetryLoop:
    """A supervised thread publishing ``{"ts": unix seconds, **metrics.snapshot(), **device.collect()}``.

    The first message goes out one interval after :meth:`start` (so rates and CPU percentages
    cover a full interval). Ticks are scheduled on a fixed grid, so a slow ``publish`` does not
    make the period drift; ticks missed entirely are skipped, not bunched. A failing ``publish``
    (broker down, payload refused) is logged as ``telemetry.publish.failed`` and the loop goes on.
    The thread is not a daemon: the application's ordered stop sets ``stop`` and joins it.
    """

    def __init__(
        self,
        metrics: Metrics,
        device: DeviceStats | None,
        publish: Publish,
        interval_s: float,
        stop: threading.Event,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"telemetry interval must be > 0 seconds, got {interval_s}")
        self.metrics = metrics
        self.device = device
        self.publish = publish
        self.interval_s = interval_s
        self.stop = stop
        self.published = 0  # messages handed to publish without an exception
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            raise RuntimeError("TelemetryLoop.start() called twice")
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=False)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after ``stop`` is set); True if it has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def build(self) -> dict[str, float]:
        """One telemetry message: timestamp, metrics snapshot, device stats."""
        message: dict[str, float] = {"ts": time.time()}
        message.update(self.metrics.snapshot())
        if self.device is not None:
            message.update(self.device.collect())
        return message

    def tick(self) -> bool:
        """Build and publish one message; False (and logged) if either step failed."""
        try:
            message = self.build()
        except Exception as exc:
            log.exception("telemetry.collect.failed", error=repr(exc))
            return False
        try:
            self.publish(message)
        except Exception as exc:  # noqa: BLE001 - supervised loop: a broker outage must not end telemetry
            log.warning("telemetry.publish.failed", error=repr(exc), fields=len(message))
            return False
        self.published += 1
        return True

    def _run(self) -> None:
        log.info("telemetry.loop.started", interval_s=self.interval_s)
        next_at = time.monotonic() + self.interval_s
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            self.tick()
            now = time.monotonic()
            next_at += self.interval_s
            if next_at <= now:  # fell behind by a whole interval: skip ahead instead of bursting
                next_at = now + self.interval_s
        log.info("telemetry.loop.stopped", published=self.published)
