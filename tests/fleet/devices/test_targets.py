"""``--select`` on a real broker: devices chosen from their retained ``up/info``, shown, nothing sent."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.devices.selector import parse_selector
from agent.fleet.devices.targets import choose
from agent.fleet.view.status import DeviceRow
from agent.protocol.messages import CommandReply, InfoMessage, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import tiny_model, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient

#: Three devices: two in Berlin (one without DLA), one in Paris.
FLEET = {
    "jet-b1": ({"site": "berlin-3", "camera": "dock"}, 2),
    "jet-b2": ({"site": "berlin-3", "camera": "gate"}, 0),
    "jet-p1": ({"site": "paris-1", "camera": "dock"}, 2),
}


def _publish_fleet(probe: Probe, prefix: str) -> None:
    """Each device's retained status and info, as its agent publishes them on connect."""
    for device, (labels, dla) in FLEET.items():
        topics = Topics(prefix, device)
        status = StatusMessage(state="online", session=1, agent_version="0.2.0")
        info = InfoMessage(
            device_id=device,
            agent_version="0.2.0",
            platform={"dla_cores": dla},
            labels=labels,
            backends={},
            slots={},
            streams=[],
        )
        probe.publish(topics.status, encode(status), retain=True)
        probe.publish(topics.info, encode(info), retain=True)


def _broker_args(broker: Broker, prefix: str) -> list[str]:
    return ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix, "--retained-wait", "2"]


def test_deploy_dry_run_lists_exactly_the_matching_devices_and_sends_nothing(
    broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "m.onnx")
    with Probe(broker.host, broker.port) as probe:
        _publish_fleet(probe, prefix)
        probe.subscribe(f"{prefix}/+/down/#")
        code = main(
            [
                "fleet", "deploy", str(model), "--slot", "cls", "--version", "2", "--unsigned",
                "--select", "site=berlin-3", "--dry-run", *_broker_args(broker, prefix),
            ]
        )  # fmt: skip
        out = capsys.readouterr().out
        probe.settle(0.5)
        sent = probe.snapshot()
    assert code == 0
    assert (
        "deploy: --select site=berlin-3: 2 of 3 device(s) with a retained up/info match: jet-b1, jet-b2"
        in out
    )
    assert "deploy: selected 2 device(s): jet-b1, jet-b2" in out
    assert "jet-p1" not in out
    assert out.rstrip().endswith("deploy: --dry-run: nothing sent")
    assert sent == []  # no desired state, no chunk, no command: nothing under down/


def test_select_and_device_together_and_platform_keys(
    broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    with Probe(broker.host, broker.port) as probe:
        _publish_fleet(probe, prefix)
        probe.subscribe(f"{prefix}/+/down/#")
        code = main(
            [
                "fleet", "cmd", "status", "--select", "camera=dock,platform.dla_cores>=1",
                "--device", "jet-b2", "--dry-run", *_broker_args(broker, prefix),
            ]
        )  # fmt: skip
        shown = capsys.readouterr()
        probe.settle(0.3)
        assert probe.snapshot() == []
    assert code == 0
    # `fleet cmd` prints JSON on stdout: the selection goes to stderr.
    assert "cmd: selected 3 device(s): jet-b2, jet-b1, jet-p1" in shown.err  # --device ids first
    assert shown.out == ""


def test_cmd_goes_to_each_selected_device_and_a_silent_one_does_not_hide_the_others(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    answering = Topics(prefix, "jet-b1")  # jet-p1 matches too, and never answers
    with Probe(broker.host, broker.port) as probe:
        _publish_fleet(probe, prefix)
        probe.subscribe(answering.cmd("status"))

        def device() -> None:  # jet-b1's agent answering its command (as tests/fleet/devices/test_command.py)
            request = probe.wait_for_count(answering.cmd("status"), 1, timeout=10)[0]
            reply = CommandReply(command="status", ok=True, result={"device": "jet-b1"})
            probe.publish(
                answering.cmd_reply("status"), encode(reply), correlation_data=request.correlation_data
            )

        thread = threading.Thread(target=device, daemon=True)
        thread.start()
        code = main(
            [
                "fleet",
                "cmd",
                "status",
                "--select",
                "camera=dock",
                "--timeout",
                "1",
                *_broker_args(broker, prefix),
            ]
        )
        thread.join(patient(5))
    shown = capsys.readouterr()
    replies = json.loads(shown.out)  # stdout is the JSON alone (`fleet cmd ... > out.json`)
    assert "cmd: selected 2 device(s)" in shown.err
    assert code == 1  # one device did not answer
    assert (replies["jet-b1"]["ok"], replies["jet-b1"]["result"]) == (True, {"device": "jet-b1"})
    assert replies["jet-p1"]["ok"] is False
    assert "no reply to command 'status' from device 'jet-p1'" in replies["jet-p1"]["error"]
    assert list(replies) == ["jet-b1", "jet-p1"]


def test_a_selection_that_matches_nothing_sends_nothing_and_says_so(
    broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "m.onnx")
    with Probe(broker.host, broker.port) as probe:
        _publish_fleet(probe, prefix)
        code = main(
            [
                "fleet", "deploy", str(model), "--slot", "cls", "--version", "2", "--unsigned",
                "--select", "site=oslo", *_broker_args(broker, prefix),
            ]
        )  # fmt: skip
    assert code == 1
    assert "error: --select site=oslo: no device matches (3 device(s)" in capsys.readouterr().err


def test_status_select_filters_the_rows(broker: Broker, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = unique_prefix()
    with Probe(broker.host, broker.port) as probe:
        _publish_fleet(probe, prefix)
        code = main(
            ["fleet", "status", "--json", "--telemetry-wait", "0", "--retained-wait", "2",
             "--select", "camera=dock", "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
        )  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["device"], r["labels"]["site"]) for r in rows] == [
        ("jet-b1", "berlin-3"),
        ("jet-p1", "paris-1"),
    ]


def test_a_bad_selector_is_refused_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 has no broker: the error is the selector's, not a connection error.
    code = main(["fleet", "cmd", "status", "--select", "site in (a", "--broker", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines() == [
        "error: --select: at column 11: expected ',' or ')' in the set of values, found the end",
        "error:   site in (a",
        "error:             ^",
    ]


def test_a_device_without_retained_info_is_never_selected() -> None:
    rows = [DeviceRow("jet-old", state="online"), DeviceRow("jet-new", info_seen=True, agent_version="0.2")]
    targets = choose(rows, parse_selector("!camera"), ())
    assert targets.devices == ("jet-new",)
    assert targets.without_info == ("jet-old",)
    assert "not evaluated (no retained up/info, or it did not parse): jet-old" in targets.lines()
