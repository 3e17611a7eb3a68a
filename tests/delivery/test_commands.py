"""Commands over a real broker: correlation data echoed, response topics, errors with stable codes."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from agent.protocol.command_args import CalibrateArgs
from agent.protocol.messages import CommandReply, decode
from tests.delivery.delivery_stack import SLOT, Harness


def _reply(device: Harness, topic: str, correlation: bytes) -> CommandReply:
    def arrived(ms: list) -> bool:  # type: ignore[type-arg]
        return any(m.topic == topic and m.correlation_data == correlation for m in ms)

    device.probe.wait_for(arrived)
    [msg] = [m for m in device.probe.on_topic(topic) if m.correlation_data == correlation]
    return decode(CommandReply, msg.payload)


def test_status_round_trip_with_correlation_data(device: Harness) -> None:
    device.probe.publish(device.topics.cmd("status"), b"{}", correlation_data=b"corr-1")
    reply = _reply(device, device.topics.cmd_reply("status"), b"corr-1")
    assert reply.ok
    assert reply.command == "status"
    assert reply.result is not None
    assert reply.result["slots"] == {SLOT: {"state": "active"}}
    assert reply.result["delivery"]["require_signature"] is True


def test_reply_also_goes_to_a_response_topic_inside_the_up_tree(device: Harness) -> None:
    inside = f"fleet/v1/{device.device_id}/up/cmd/answers-42"
    device.probe.publish(device.topics.cmd("status"), b"", response_topic=inside, correlation_data=b"c2")
    assert _reply(device, inside, b"c2").ok
    assert _reply(device, device.topics.cmd_reply("status"), b"c2").ok

    outside = f"fleet/v1/{device.device_id}/down/desired/{SLOT}"
    device.probe.subscribe(outside)
    device.probe.publish(device.topics.cmd("status"), b"{}", response_topic=outside, correlation_data=b"c3")
    assert _reply(device, device.topics.cmd_reply("status"), b"c3").ok
    device.probe.settle(0.3)
    assert device.probe.on_topic(outside) == []  # never made to publish on its own down/ tree


def test_rollback_calls_the_slot_and_checks_args(device: Harness) -> None:
    device.probe.publish(device.topics.cmd("rollback"), b'{"args": {"slot": "main"}}', correlation_data=b"r1")
    reply = _reply(device, device.topics.cmd_reply("rollback"), b"r1")
    assert reply.ok
    assert reply.result == {"slot": "main", "model_id": "previous", "version": "1"}
    assert device.rollbacks == ["main"]

    device.probe.publish(device.topics.cmd("rollback"), b'{"args": {}}', correlation_data=b"r2")
    reply = _reply(device, device.topics.cmd_reply("rollback"), b"r2")
    assert (reply.ok, reply.error_code) == (False, "bad_args")
    assert device.rollbacks == ["main"]


def test_unknown_command_and_malformed_request(device: Harness) -> None:
    device.probe.publish(device.topics.cmd("reboot"), b"{}", correlation_data=b"u1")
    reply = _reply(device, device.topics.cmd_reply("reboot"), b"u1")
    assert (reply.ok, reply.error_code) == (False, "unknown_command")
    assert "rollback" in (reply.error or "")
    assert "status" in (reply.error or "")

    device.probe.publish(device.topics.cmd("status"), b"{not json", correlation_data=b"m1")
    reply = _reply(device, device.topics.cmd_reply("status"), b"m1")
    assert (reply.ok, reply.error_code) == (False, "bad_message")


def test_registered_command_and_handler_error(device: Harness) -> None:
    from agent.errors import BuildError

    def calibrate(args: dict[str, object]) -> dict[str, object]:
        raise BuildError(f"cannot calibrate {args.get('slot')}: no frames yet")

    device.service.register_command("calibrate", calibrate)
    device.probe.publish(device.topics.cmd("calibrate"), b'{"args": {"slot": "main"}}', correlation_data=b"k")
    reply = _reply(device, device.topics.cmd_reply("calibrate"), b"k")
    assert (reply.ok, reply.error_code) == (False, "build_failed")
    assert reply.error == "cannot calibrate main: no frames yet"


def test_a_command_without_a_name_is_refused_on_one_line_and_counted(device: Harness) -> None:
    """``down/cmd/`` (an empty level) matches ``down/cmd/+``; it is refused, never a crash."""
    answers = f"fleet/v1/{device.device_id}/up/cmd/answers"
    with capture_logs() as logs:
        device.probe.publish(
            f"fleet/v1/{device.device_id}/down/cmd/", b"{}", response_topic=answers, correlation_data=b"e1"
        )
        reply = _reply(device, answers, b"e1")
    assert (reply.ok, reply.error_code) == (False, "unknown_command")
    assert "down/cmd/{name}" in (reply.error or "")
    assert device.service.commands.stats()["refused"] == 1
    events = [entry["event"] for entry in logs]
    assert "delivery.command.refused" in events
    assert "delivery.command.crashed" not in events
    # The worker thread goes on serving.
    device.probe.publish(device.topics.cmd("status"), b"{}", correlation_data=b"e2")
    assert _reply(device, device.topics.cmd_reply("status"), b"e2").ok


def test_wrong_arguments_are_bad_args_naming_the_argument(device: Harness) -> None:
    calls: list[CalibrateArgs] = []

    def calibrate(args: CalibrateArgs) -> dict[str, object]:
        calls.append(args)
        return {"slot": args.slot, "frames": args.frames}

    device.service.register_command("calibrate", calibrate, CalibrateArgs)
    cases = [
        (
            "calibrate",
            {"slot": "main", "frames": "many"},
            ["'frames'", "'many'", "calibrate takes: slot, frames"],
        ),
        ("calibrate", {"slot": "main", "frames": 0}, ["'frames'", "greater than or equal to 1"]),
        ("calibrate", {"slot": "main", "frame": 50}, ["unknown argument 'frame'"]),
        ("rollback", {"slot": 7}, ["'slot'", "valid string"]),
        ("rollback", {}, ["argument 'slot' is missing"]),
        ("status", {"verbose": True}, ["unknown argument 'verbose'", "status takes: no arguments"]),
    ]
    for i, (name, args, words) in enumerate(cases):
        correlation = f"b{i}".encode()
        device.probe.publish(
            device.topics.cmd(name), json.dumps({"args": args}), correlation_data=correlation
        )
        reply = _reply(device, device.topics.cmd_reply(name), correlation)
        assert (reply.ok, reply.error_code) == (False, "bad_args"), reply
        for word in words:
            assert word in (reply.error or ""), (word, reply.error)
    assert calls == []
    assert device.rollbacks == []
    assert device.service.commands.stats()["refused"] == len(cases)

    device.probe.publish(
        device.topics.cmd("calibrate"), b'{"args": {"slot": "main"}}', correlation_data=b"ok"
    )
    reply = _reply(device, device.topics.cmd_reply("calibrate"), b"ok")
    assert reply.ok, reply
    assert reply.result == {"slot": "main", "frames": 200}
    assert device.service.commands.stats()["served"] == 1
