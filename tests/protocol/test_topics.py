"""The topic tree: spelling, level validation, fleet filters and parsing."""

from __future__ import annotations

import pytest

from agent.protocol.topics import ParsedTopic, Topics, fleet_filter, parse


def test_device_topics() -> None:
    t = Topics("fleet/v1", "jet-01")
    assert t.status == "fleet/v1/jet-01/up/status"
    assert t.info == "fleet/v1/jet-01/up/info"
    assert t.telemetry == "fleet/v1/jet-01/up/telemetry"
    assert t.xfer_req == "fleet/v1/jet-01/up/xfer/req"
    assert t.results("cam0") == "fleet/v1/jet-01/up/results/cam0"
    assert t.jobs("j-1") == "fleet/v1/jet-01/up/jobs/j-1"
    assert t.cmd_reply("status") == "fleet/v1/jet-01/up/cmd/status"
    assert t.desired_filter == "fleet/v1/jet-01/down/desired/+"
    assert t.cmd_filter == "fleet/v1/jet-01/down/cmd/+"
    assert t.xfer_filter == "fleet/v1/jet-01/down/xfer/+"
    assert t.desired("main") == "fleet/v1/jet-01/down/desired/main"
    assert t.xfer("ab" * 32) == f"fleet/v1/jet-01/down/xfer/{'ab' * 32}"
    assert t.cmd("rollback") == "fleet/v1/jet-01/down/cmd/rollback"


@pytest.mark.parametrize("bad", ["", "a/b", "a+", "#", "x\0"])
def test_arguments_must_be_one_level(bad: str) -> None:
    t = Topics("fleet/v1", "jet-01")
    for method in (t.results, t.jobs, t.cmd_reply, t.desired, t.xfer, t.cmd):
        with pytest.raises(ValueError, match="topic level"):
            method(bad)
    with pytest.raises(ValueError):
        Topics("fleet/v1", bad)


@pytest.mark.parametrize("bad", ["", "fleet//v1", "fleet/+", "fleet/#", "/fleet", "fleet/"])
def test_prefix_is_validated(bad: str) -> None:
    with pytest.raises(ValueError):
        Topics(bad, "jet-01")


def test_fleet_filters() -> None:
    assert fleet_filter("fleet/v1", "status") == "fleet/v1/+/up/status"
    assert fleet_filter("fleet/v1", "jobs") == "fleet/v1/+/up/jobs/+"
    assert fleet_filter("fleet/v1", "desired", "down") == "fleet/v1/+/down/desired/+"
    with pytest.raises(ValueError, match="unknown up topic kind"):
        fleet_filter("fleet/v1", "nope")


def test_parse_round_trips_every_topic() -> None:
    t = Topics("site/a/fleet", "jet-01")
    cases = {
        t.status: ("up", "status", None),
        t.info: ("up", "info", None),
        t.telemetry: ("up", "telemetry", None),
        t.xfer_req: ("up", "xfer", "req"),
        t.results("cam0"): ("up", "results", "cam0"),
        t.jobs("j1"): ("up", "jobs", "j1"),
        t.cmd_reply("status"): ("up", "cmd", "status"),
        t.desired("main"): ("down", "desired", "main"),
        t.xfer("abc"): ("down", "xfer", "abc"),
        t.cmd("rollback"): ("down", "cmd", "rollback"),
    }
    for topic, (direction, kind, arg) in cases.items():
        assert parse(topic, "site/a/fleet") == ParsedTopic("jet-01", direction, kind, arg)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "topic",
    [
        "other/v1/jet/up/status",
        "fleet/v1/jet/up",
        "fleet/v1/jet/sideways/status",
        "fleet/v1/jet/up/status/extra",
        "fleet/v1/jet/up/results",
        "fleet/v1/jet/up/xfer/other",
        "fleet/v1/jet/down/status",
        "fleet/v1//up/status",
    ],
)
def test_parse_refuses_topics_outside_the_tree(topic: str) -> None:
    with pytest.raises(ValueError):
        parse(topic)
