"""The agent's health reading: what the lifecycle rule judges an agent release (and a configuration) by."""

from __future__ import annotations

from agent.app.health_reading import read_health
from agent.camera.source import SourceReport, SourceState
from agent.lifecycle.health import unhealthy_because
from agent.runtime.slots.slot import ModelSlot


def report(state: SourceState, frames: int) -> SourceReport:
    return SourceReport(
        state=state, since=0.0, frames=frames, reconnects=0, last_error=None, last_error_at=None
    )


def test_a_streaming_camera_flows_a_reconnecting_one_does_not_and_an_empty_slot_fails() -> None:
    cameras = {
        "door": report(SourceState.STREAMING, 120),
        "yard": report(SourceState.RECONNECTING, 40),
        "gate": report(SourceState.STREAMING, 0),
    }
    reading = read_health(lambda: True, lambda: cameras, {"main": ModelSlot("main")})
    assert reading.connected
    assert reading.streams == {"door", "yard", "gate"}
    assert reading.streams_flowing == {"door"}
    assert reading.slots_failing == {"main"}


def test_a_stream_that_flowed_before_and_stalls_makes_the_agent_unhealthy() -> None:
    flowing = {"door": report(SourceState.STREAMING, 120)}
    before = read_health(lambda: True, lambda: flowing, {})
    stalled = {"door": report(SourceState.RECONNECTING, 120)}
    assert unhealthy_because(before, read_health(lambda: True, lambda: stalled, {})) == (
        "no frames on stream(s) door, which flowed before the change"
    )
    assert (
        unhealthy_because(before, read_health(lambda: False, lambda: flowing, {}))
        == "not connected to the broker"
    )
