"""The agent's health as the one lifecycle rule reads it (agent/lifecycle/health.py): connected, the
streams that flow, the slots with no model, read from the components as they are now."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from agent.camera.source import SourceReport, SourceState
from agent.lifecycle.health import HealthReading
from agent.runtime.slots.slot import ModelSlot


def read_health(
    connected: Callable[[], bool],
    cameras: Callable[[], Mapping[str, SourceReport]],
    slots: Mapping[str, ModelSlot],
) -> HealthReading:
    """One reading. A stream flows while its source streams and has delivered frames (a source that
    stalls without failing is the frame loop's watchdog's to catch); a slot fails while it serves no model."""
    reports = cameras()
    return HealthReading(
        connected=connected(),
        streams_flowing=frozenset(
            name
            for name, report in reports.items()
            if report.state is SourceState.STREAMING and report.frames
        ),
        streams=frozenset(reports),
        slots_failing=frozenset(name for name, slot in slots.items() if slot.current is None),
    )
