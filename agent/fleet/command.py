"""``fleet cmd``: one command to one device, matched to its reply by MQTT 5 correlation data.

The request goes to ``down/cmd/{name}`` with the response topic ``up/cmd/{name}`` of that device
(the device answers there anyway; naming it lets an ACL-checked broker and the device agree) and
random correlation data; the device echoes the correlation data, so replies to other operators'
requests on the same topic are told apart.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from agent.errors import TransportError
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import CommandReply, CommandRequest, ProtocolError, decode, encode
from agent.protocol.topics import Topics


class NoReplyError(TransportError):
    """A command got no reply in time (device offline, or the broker refused the request)."""

    code = "no_reply"


class PendingReplies:
    """Command requests waiting for their reply, by correlation data (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[bytes, CommandReply | None] = {}
        #: Replies that arrived for a request nobody waits for (another operator's, or late).
        self.unmatched = 0

    def expect(self) -> bytes:
        """New correlation data to send with a request; its reply will be kept."""
        correlation = uuid.uuid4().bytes
        with self._cond:
            self._waiting[correlation] = None
        return correlation

    def offer(self, message: InboundMessage) -> bool:
        """Keep ``message`` if it is an awaited reply; True if it was one (even if malformed)."""
        correlation = message.correlation_data
        with self._cond:
            if correlation is None or correlation not in self._waiting:
                self.unmatched += 1
                return False
        try:
            reply = decode(CommandReply, message.payload)
        except ProtocolError as exc:
            name = message.topic.rsplit("/", 1)[-1]
            reply = CommandReply(command=name, ok=False, error_code=exc.code, error=str(exc))
        with self._cond:
            if correlation in self._waiting:
                self._waiting[correlation] = reply
                self._cond.notify_all()
        return True

    def take(self, correlation: bytes) -> CommandReply | None:
        """The reply for ``correlation`` if it arrived (then forgotten), else None (still awaited)."""
        with self._cond:
            reply = self._waiting.get(correlation)
            if reply is not None:
                del self._waiting[correlation]
            return reply

    def forget(self, correlation: bytes) -> None:
        """Stop waiting for ``correlation`` (a late reply counts as unmatched)."""
        with self._cond:
            self._waiting.pop(correlation, None)

    def wait(self, correlation: bytes, timeout: float) -> CommandReply | None:
        """Wait up to ``timeout`` seconds for the reply; None if it did not come."""
        with self._cond:
            self._cond.wait_for(lambda: self._waiting.get(correlation) is not None, timeout)
        reply = self.take(correlation)
        if reply is None:
            self.forget(correlation)
        return reply


def publish_command(
    client: ServiceClient, topics: Topics, name: str, args: dict[str, Any], correlation: bytes
) -> None:
    """Publish a CommandRequest for ``topics.device_id`` (the reply topic must be subscribed already)."""
    properties = PublishProperties(response_topic=topics.cmd_reply(name), correlation_data=correlation)
    client.publish(topics.cmd(name), encode(CommandRequest(args=args)), qos=1, properties=properties)


def send_command(
    settings: MqttSettings,
    device: str,
    name: str,
    args: dict[str, Any] | None = None,
    *,
    timeout: float = 10.0,
) -> CommandReply:
    """Send command ``name`` to ``device`` and return its reply; NoReplyError after ``timeout``.

    Commands are not retained: a device that is offline gets it when it reconnects only if its
    broker session still exists, so the caller should expect a timeout for an offline device.
    """
    topics = Topics(settings.prefix, device)
    pending = PendingReplies()
    client = ServiceClient(settings, handler=pending.offer)
    client.start(timeout=min(timeout, 10.0))
    try:
        client.subscribe(topics.cmd_reply(name), qos=1, timeout=timeout)
        correlation = pending.expect()
        publish_command(client, topics, name, dict(args or {}), correlation)
        reply = pending.wait(correlation, timeout)
    finally:
        client.stop()
    if reply is None:
        raise NoReplyError(
            f"no reply to command {name!r} from device {device!r} within {timeout:.0f}s; is it online "
            "(`edge-agent fleet status`) and is the topic prefix right?"
        )
    return reply
