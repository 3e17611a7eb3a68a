"""``fleet cmd``: request with response topic and correlation data, the matching reply only."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from agent.fleet.command import NoReplyError, send_command
from agent.localbroker import Broker
from agent.protocol.messages import CommandReply, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe


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
    thread.join(5)

    assert reply.ok
    assert reply.result == {"args": {"slot": "cls"}}


def test_no_reply_is_an_error_naming_the_device(broker: Broker) -> None:
    with pytest.raises(NoReplyError, match="'nobody'"):
        send_command(operator_settings(broker, unique_prefix()), "nobody", "status", timeout=0.5)
