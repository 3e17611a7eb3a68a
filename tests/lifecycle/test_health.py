"""The one health rule a configuration change and an agent release are both judged by."""

from __future__ import annotations

from agent.lifecycle.health import HealthReading, unhealthy_because


def _reading(
    *, connected: bool = True, flowing: set[str], streams: set[str], failing: frozenset[str] = frozenset()
) -> HealthReading:
    return HealthReading(connected, frozenset(flowing), frozenset(streams), failing)


BEFORE = _reading(flowing={"dock", "gate"}, streams={"dock", "gate", "yard"})


def test_healthy_when_every_stream_that_flowed_still_flows() -> None:
    now = _reading(flowing={"dock", "gate", "yard"}, streams={"dock", "gate", "yard"})
    assert unhealthy_because(BEFORE, now) is None


def test_disconnected_is_unhealthy() -> None:
    reason = unhealthy_because(
        BEFORE, _reading(connected=False, flowing={"dock", "gate"}, streams={"dock", "gate"})
    )
    assert reason == "not connected to the broker"


def test_a_device_offline_before_the_change_need_not_connect() -> None:
    offline = _reading(connected=False, flowing={"dock"}, streams={"dock"})
    assert unhealthy_because(offline, offline) is None
    reason = unhealthy_because(offline, _reading(connected=False, flowing=set(), streams={"dock"}))
    assert reason is not None
    assert "dock" in reason


def test_a_stream_that_flowed_and_stopped_is_named() -> None:
    reason = unhealthy_because(BEFORE, _reading(flowing={"dock"}, streams={"dock", "gate", "yard"}))
    assert reason is not None
    assert "gate" in reason
    assert "dock" not in reason


def test_a_stream_the_change_removed_is_not_held_against_it() -> None:
    assert unhealthy_because(BEFORE, _reading(flowing={"dock"}, streams={"dock"})) is None


def test_a_stream_that_never_flowed_need_not_flow_now() -> None:
    assert (
        unhealthy_because(BEFORE, _reading(flowing={"dock", "gate"}, streams={"dock", "gate", "yard"}))
        is None
    )


def test_a_slot_failing_since_the_change_is_named_but_not_one_that_failed_before() -> None:
    before = _reading(flowing={"dock"}, streams={"dock"}, failing=frozenset({"old"}))
    assert (
        unhealthy_because(before, _reading(flowing={"dock"}, streams={"dock"}, failing=frozenset({"old"})))
        is None
    )
    reason = unhealthy_because(
        before, _reading(flowing={"dock"}, streams={"dock"}, failing=frozenset({"old", "people"}))
    )
    assert reason == "slot(s) people failing"
