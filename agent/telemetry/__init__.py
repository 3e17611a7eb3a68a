"""Telemetry: the metrics registry, device statistics and the loop that publishes both.

``from agent.telemetry import Metrics, DeviceStats, TelemetryLoop`` is the public entry point.
"""

from __future__ import annotations

from agent.telemetry.device import DeviceStats
from agent.telemetry.loop import TelemetryLoop
from agent.telemetry.metrics import Counter, Gauge, Histogram, Metrics, RateMeter

__all__ = ["Counter", "DeviceStats", "Gauge", "Histogram", "Metrics", "RateMeter", "TelemetryLoop"]
