"""``fleet cmd``: request with response topic and correlation data, the matching reply only."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.devices.command import NoReplyError, answer_json, ask_devices, send_command
from agent.protocol.messages import CommandReply, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import announce, operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient


@pytest.fixture
def probe(broker: Broker) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as p:
        yield p


def test_the_reply_with_our_correlation_data_is_returned(broker: Broker, probe: Probe) -> None:
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-1")
    probe.subscribe(topics.cmd("rollback"))

    def device() -> None:
        request = probe.wait_for_count(topics.cmd("rollback"), 1, timeout=10)[0]
        assert request.response_topic == topics.cmd_reply("rollback")
        stranger = CommandReply(command="rollback", ok=False, error_code="other")
        probe.publish(topics.cmd_reply("rollback"), encode(stranger), correlation_data=b"someone-else")
        mine = CommandReply(command="rollback", ok=True, result={"args": json.loads(request.payload)["args"]})
        probe.publish(request.response_topic, encode(mine), correlation_data=request.correlation_data)

    thread = threading.Thread(target=device, daemon=True)
    thread.start()
    reply = send_command(operator_settings(broker, prefix), "jet-1", "rollback", {"slot": "cls"}, timeout=10)
    thread.join(patient(5))

    assert reply.ok
    assert reply.result == {"args": {"slot": "cls"}}


def test_no_reply_is_an_error_naming_the_device(broker: Broker) -> None:
    with pytest.raises(NoReplyError, match="'nobody'"):
        send_command(operator_settings(broker, unique_prefix()), "nobody", "status", timeout=0.5)


def _answer_once_all_asked(probe: Probe, prefix: str, devices: list[str], name: str) -> threading.Thread:
    """Stand-ins for the devices' agents: they answer only once every one of them has its request,
    so an operator that waits for one reply before asking the next device gets none."""

    def run() -> None:
        requests = probe.wait_for(
            lambda ms: {m.topic for m in ms} >= {Topics(prefix, d).cmd(name) for d in devices}, timeout=30
        )
        for request in requests:
            device = request.topic.split("/")[-4]
            if device not in devices:
                continue  # offline: it hears nothing
            reply = CommandReply(command=name, ok=True, result={"device": device})
            assert request.response_topic is not None
            probe.publish(request.response_topic, encode(reply), correlation_data=request.correlation_data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_many_devices_are_asked_at_once_every_request_before_any_reply(broker: Broker, probe: Probe) -> None:
    prefix = unique_prefix()
    devices = ["jet-1", "jet-2", "jet-3", "jet-4"]
    announce(probe, prefix, *devices)
    probe.subscribe(f"{prefix}/+/down/cmd/status")
    thread = _answer_once_all_asked(probe, prefix, devices, "status")
    answers = {
        d: answer_json(a)
        for d, a in ask_devices(operator_settings(broker, prefix), devices, "status", timeout=60).items()
    }
    thread.join(patient(5))
    assert list(answers) == devices
    assert {d: (a["ok"], a["result"]) for d, a in answers.items()} == {
        d: (True, {"device": d}) for d in devices
    }


def test_a_device_whose_retained_status_says_offline_is_answered_offline_not_waited_for(
    broker: Broker, probe: Probe
) -> None:
    """``jet-off`` never answers; the others answer once all three online devices are asked. With
    the whole command under a 600 s timeout, waiting for ``jet-off`` would run into pytest's."""
    prefix = unique_prefix()
    online = ["jet-1", "jet-2", "jet-3"]
    announce(probe, prefix, *online)
    offline = StatusMessage(state="offline", session=1, agent_version="test")
    probe.publish(Topics(prefix, "jet-off").status, encode(offline), retain=True)
    probe.subscribe(f"{prefix}/+/down/cmd/status")
    thread = _answer_once_all_asked(probe, prefix, online, "status")
    settings = operator_settings(broker, prefix)
    asked = ask_devices(settings, ["jet-off", *online], "status", timeout=600)
    answers = {d: answer_json(a) for d, a in asked.items()}
    thread.join(patient(5))
    assert list(answers) == ["jet-off", *online]
    assert answers["jet-off"]["ok"] is False
    assert answers["jet-off"]["error_code"] == "offline"
    assert all(answers[d]["ok"] for d in online)
    # The request still went out (a persistent session delivers it when the device is back).
    assert probe.on_topic(Topics(prefix, "jet-off").cmd("status"))


def test_a_device_that_does_not_answer_is_no_reply_and_costs_the_others_nothing(broker: Broker) -> None:
    asked = ask_devices(operator_settings(broker, unique_prefix()), ["nobody"], "status", timeout=0.5)
    assert {d: answer_json(a) for d, a in asked.items()} == {
        "nobody": {
            "ok": False,
            "error_code": "no_reply",
            "error": "no reply to command 'status' from device 'nobody' within 0s",
        }
    }


def test_fleet_cmd_to_one_offline_device_says_so_at_once(
    broker: Broker, probe: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fleet cmd jet-off status`` with a 600 s timeout: the retained status answers, not the timeout."""
    from agent.cli import main

    prefix = unique_prefix()
    offline = StatusMessage(state="offline", session=1, agent_version="test")
    probe.publish(Topics(prefix, "jet-off").status, encode(offline), retain=True)
    argv = ["fleet", "cmd", "jet-off", "status", "--timeout", "600"]
    assert main([*argv, "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]) == 1
    shown = capsys.readouterr()
    assert shown.out == ""
    assert shown.err.splitlines() == [
        "error: device 'jet-off' is offline (its retained up/status); not waited for: the command "
        "reaches it only if its broker session outlives the disconnect"
    ]


def test_a_reply_on_another_devices_topic_does_not_answer_for_it(broker: Broker, probe: Probe) -> None:
    """jet-2 (or whoever holds its credentials) saw jet-1's correlation data somehow and answers on
    its own reply topic: that is no reply from jet-1."""
    prefix = unique_prefix()
    announce(probe, prefix, "jet-1", "jet-2")
    probe.subscribe(Topics(prefix, "jet-1").cmd("status"))

    def impostor() -> None:
        request = probe.wait_for_count(Topics(prefix, "jet-1").cmd("status"), 1, timeout=10)[0]
        forged = CommandReply(command="status", ok=True, result={"device": "jet-1"})
        probe.publish(
            Topics(prefix, "jet-2").cmd_reply("status"),
            encode(forged),
            correlation_data=request.correlation_data,
        )

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    [answer] = ask_devices(operator_settings(broker, prefix), ["jet-1"], "status", timeout=2).values()
    thread.join(patient(5))
    assert answer_json(answer)["error_code"] == "no_reply"


@pytest.mark.parametrize(
    "argv",
    [
        ["snapshot", "jet-off", "-o", "{tmp}/frame.jpg"],
        ["logs", "jet-off"],
        ["logs", "jet-off", "--follow"],
        ["evidence", "jet-off", "job-1", "-o", "{tmp}/evidence"],
    ],
    ids=["snapshot", "logs", "logs-follow", "evidence"],
)
def test_snapshot_logs_and_evidence_to_an_offline_device_say_so_at_once(
    argv: list[str], tmp_path: Path, broker: Broker, probe: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``fleet cmd``: a 600 s timeout, and the retained status answers rather than the timeout
    (waiting it out would run into pytest's own)."""
    from agent.cli import main

    prefix = unique_prefix()
    offline = StatusMessage(state="offline", session=1, agent_version="test")
    probe.publish(Topics(prefix, "jet-off").status, encode(offline), retain=True)
    probe.subscribe(f"{prefix}/jet-off/down/cmd/+")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    assert main(["fleet", *argv, "--timeout", "600", *broker_args]) == 1
    shown = capsys.readouterr()
    assert shown.out == ""
    assert shown.err.splitlines() == [
        "error: device 'jet-off' is offline (its retained up/status); not waited for: the command "
        "reaches it only if its broker session outlives the disconnect"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written
    # The request still went out (a persistent session delivers it when the device is back).
    probe.wait_for(lambda ms: any(m.topic == Topics(prefix, "jet-off").cmd(argv[0]) for m in ms), timeout=10)


def _answer_running_then(
    probe: Probe, topics: Topics, name: str, release: threading.Event
) -> threading.Thread:
    """A device whose work goes on: ``state: running`` at once, the final reply once ``release`` is set."""

    def run() -> None:
        request = probe.wait_for_count(topics.cmd(name), 1, timeout=10)[0]
        assert request.response_topic is not None
        running = CommandReply(command=name, ok=True, result={"slot": "cls", "state": "running"})
        probe.publish(request.response_topic, encode(running), correlation_data=request.correlation_data)
        assert release.wait(patient(30))
        final = CommandReply(command=name, ok=True, result={"slot": "cls", "model": {"version": "1"}})
        probe.publish(request.response_topic, encode(final), correlation_data=request.correlation_data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_device_that_answers_running_is_followed_to_its_final_reply_past_the_timeout(
    broker: Broker, probe: Probe
) -> None:
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-1")
    announce(probe, prefix, "jet-1")
    probe.subscribe(topics.cmd("rollback"))
    release = threading.Event()
    heard: list[str] = []
    device = _answer_running_then(probe, topics, "rollback", release)

    def running(name: str, reply: CommandReply) -> None:
        heard.append(name)
        threading.Timer(1.0, release.set).start()  # the final reply comes after the 0.5 s --timeout

    [answer] = ask_devices(
        operator_settings(broker, prefix),
        ["jet-1"],
        "rollback",
        {"slot": "cls"},
        timeout=0.5,
        follow_s=30,
        on_running=running,
    ).values()
    device.join(patient(5))
    assert heard == ["jet-1"]
    assert isinstance(answer, CommandReply)
    assert answer.result == {"slot": "cls", "model": {"version": "1"}}  # the final reply, not `running`


def test_a_running_answer_is_the_answer_for_a_caller_that_does_not_follow(
    broker: Broker, probe: Probe
) -> None:
    """A snapshot or evidence call (the console's) does not wait on a device that says it is running."""
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-1")
    probe.subscribe(topics.cmd("snapshot"))
    release = threading.Event()
    device = _answer_running_then(probe, topics, "snapshot", release)
    reply = send_command(operator_settings(broker, prefix), "jet-1", "snapshot", timeout=10)
    release.set()
    device.join(patient(5))
    assert reply.result == {"slot": "cls", "state": "running"}
