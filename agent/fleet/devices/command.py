"""``fleet cmd``: a command to one device or many, matched to its replies by MQTT 5 correlation data.

The request goes to ``down/cmd/{name}`` with the response topic ``up/cmd/{name}`` of that device
(the device answers there anyway; naming it lets an ACL-checked broker and the device agree) and
random correlation data; the device echoes the correlation data, so replies to other operators'
requests on the same topic are told apart.

To many devices (:func:`ask_devices`) the requests all go out first, then the replies are awaited
together: the whole command takes at most one ``timeout``, however many devices. A device whose
retained ``up/status`` says offline is answered ``offline`` at once rather than waited for; so is
one device asked alone (:func:`send_command`, :class:`DeviceSession`: ``fleet snapshot``, ``logs``,
``evidence``).

A device whose work goes on past its reply window (a ``rollback`` that rebuilds an engine) answers
``ok: true`` with ``state: running`` first and its final reply, same correlation data, when the work
ends: ``timeout`` is the wait for a first answer, and a ``running`` one is followed for up to
``follow_s`` more before it is taken as the answer. Only a caller that asks for it follows (``fleet
cmd``, :data:`FOLLOW_S` by default; the controller briefly): a device that answers ``running`` to
any other command cannot hold the caller that long.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import AgentError, TransportError
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import (
    CommandReply,
    CommandRequest,
    ProtocolError,
    StatusMessage,
    decode,
    encode,
)
from agent.protocol.topics import Topics, fleet_filter

#: How long ``fleet cmd`` follows a command the device answered ``state: running`` to its final reply.
FOLLOW_S = 1800.0


def is_running(reply: CommandReply) -> bool:
    """Whether ``reply`` is a device's interim answer (its final reply follows)."""
    return reply.ok and isinstance(reply.result, dict) and reply.result.get("state") == "running"


class NoReplyError(TransportError):
    """A command got no reply in time (device offline, or the broker refused the request)."""

    code = "no_reply"


class PendingReplies:
    """Command requests waiting for their reply, by correlation data (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[bytes, CommandReply | None] = {}
        #: The ``running`` answers of requests whose final reply is still awaited.
        self._interim: dict[bytes, CommandReply] = {}
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
                if is_running(reply):
                    if self._waiting[correlation] is None:
                        self._interim[correlation] = reply
                else:
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

    def _given_up(self) -> bool:
        """Whether a wait ends now whatever has arrived (called under the lock)."""
        return False

    def wait(self, correlation: bytes, timeout: float, follow_s: float = 0.0) -> CommandReply | None:
        """Wait up to ``timeout`` seconds for the reply; None if it did not come. A ``running`` answer
        in time is followed up to ``follow_s`` more seconds for the final reply, else returned."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._given_up()
                    or self._waiting.get(correlation) is not None
                    or correlation in self._interim
                ),
                timeout,
            )
            if self._waiting.get(correlation) is None and correlation in self._interim:
                self._cond.wait_for(
                    lambda: self._given_up() or self._waiting.get(correlation) is not None, follow_s
                )
            interim = self._interim.pop(correlation, None)
        reply = self.take(correlation)
        if reply is None:
            self.forget(correlation)
        return reply or interim


#: ``error_code`` of a device answered by its retained ``up/status`` saying offline.
OFFLINE = "offline"


class DeviceOfflineError(NoReplyError):
    """The device's retained ``up/status`` says offline: answered at once rather than waited for."""

    code = OFFLINE


def offline_text(device: str) -> str:
    """What an operator reads for a device answered ``offline`` by its retained status."""
    return (
        f"device {device!r} is offline (its retained up/status); not waited for: the command "
        "reaches it only if its broker session outlives the disconnect"
    )


class DeviceReplies(PendingReplies):
    """The replies of one device, and its retained ``up/status``: while that says offline, a wait
    ends at once (a status that does not parse, or a cleared one, says nothing: the reply is awaited)."""

    def __init__(self, status_topic: str) -> None:
        super().__init__()
        self.status_topic = status_topic
        self.offline = False

    def offer(self, message: InboundMessage) -> bool:
        if message.topic != self.status_topic:
            return super().offer(message)
        try:
            offline = bool(message.payload) and decode(StatusMessage, message.payload).state == "offline"
        except ProtocolError:
            offline = False
        with self._cond:
            self.offline = offline
            self._cond.notify_all()
        return False

    def _given_up(self) -> bool:
        return self.offline


def _awaited(client: ServiceClient, topics: Topics, name: str, timeout: float) -> None:
    """Subscribe the device's status, then its reply topic: a retained offline status is in before
    the first request goes out."""
    client.subscribe(topics.status, qos=1, timeout=timeout)
    client.subscribe(topics.cmd_reply(name), qos=1, timeout=timeout)


def _no_reply(replies: DeviceReplies, name: str, device: str, timeout: float) -> NoReplyError:
    if replies.offline:
        return DeviceOfflineError(offline_text(device))
    return NoReplyError(
        f"no reply to command {name!r} from device {device!r} within {timeout:.0f}s; is it online "
        "(`edge-agent fleet status`) and is the topic prefix right?"
    )


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
    follow_s: float = 0.0,
) -> CommandReply:
    """Send command ``name`` to ``device`` and return its reply; NoReplyError after ``timeout``. A
    ``running`` answer is followed up to ``follow_s`` seconds for the final reply (else returned).

    Commands are not retained: a device that is offline gets it when it reconnects only if its
    broker session still exists. A device whose retained ``up/status`` says offline is not waited
    for: DeviceOfflineError at once (the request still goes out).
    """
    topics = Topics(settings.prefix, device)
    pending = DeviceReplies(topics.status)
    client = ServiceClient(settings, handler=pending.offer)
    client.start(timeout=min(timeout, 10.0))
    try:
        _awaited(client, topics, name, timeout)
        correlation = pending.expect()
        publish_command(client, topics, name, dict(args or {}), correlation)
        reply = pending.wait(correlation, timeout, follow_s)
    finally:
        client.stop()
    if reply is None:
        raise _no_reply(pending, name, device, timeout)
    return reply


class DeviceSession:
    """One connection that asks one device command ``name`` again and again (``fleet logs --follow``).

    The reply topic is subscribed once; each :meth:`ask` is a new request with its own correlation
    data, so a late reply to an earlier request is never taken for the current one.
    """

    def __init__(self, settings: MqttSettings, device: str, name: str, *, timeout: float = 10.0) -> None:
        self.device = device
        self.name = name
        self.timeout = timeout
        self.topics = Topics(settings.prefix, device)
        self._pending = DeviceReplies(self.topics.status)
        self._client = ServiceClient(settings, handler=self._pending.offer)

    def __enter__(self) -> DeviceSession:
        self._client.start(timeout=min(self.timeout, 10.0))
        try:
            _awaited(self._client, self.topics, self.name, self.timeout)
        except BaseException:
            self._client.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self._client.stop()

    def ask(self, args: dict[str, Any]) -> CommandReply:
        """The device's reply to one request; NoReplyError after the session's timeout, or at once
        (DeviceOfflineError) while its retained status says offline."""
        correlation = self._pending.expect()
        publish_command(self._client, self.topics, self.name, args, correlation)
        reply = self._pending.wait(correlation, self.timeout)
        if reply is None:
            raise _no_reply(self._pending, self.name, self.device, self.timeout)
        return reply


class DeviceRefusedError(AgentError):
    """A device answered a command ``ok: false``; ``code`` is its ``error_code``."""

    def __init__(self, reply: CommandReply) -> None:
        super().__init__(f"{reply.command}: {reply.error or 'refused'} ({reply.error_code})")
        self.code = reply.error_code or "agent_error"


class FanOut:
    """Command ``name``'s requests to many devices and what answers each (thread-safe): its reply
    (on its own reply topic), or its retained ``up/status`` saying offline (then it is not waited
    for; a reply still counts)."""

    def __init__(
        self,
        prefix: str,
        devices: Sequence[str],
        name: str,
        on_running: Callable[[str, CommandReply], None] | None = None,
    ) -> None:
        self.devices = tuple(dict.fromkeys(devices))
        self._on_running = on_running
        self.name = name
        self.topics = {device: Topics(prefix, device) for device in self.devices}
        self._status_of = {topics.status: device for device, topics in self.topics.items()}
        self._cond = threading.Condition()
        self._by_correlation: dict[bytes, str] = {}
        self.replies: dict[str, CommandReply] = {}
        #: ``running`` answers of devices whose final reply is still awaited.
        self.interim: dict[str, CommandReply] = {}
        self.offline: set[str] = set()
        #: Messages that answered nothing of ours (another operator's replies, other devices' status).
        self.unmatched = 0

    def expect(self, device: str) -> bytes:
        """New correlation data for ``device``'s request."""
        correlation = uuid.uuid4().bytes
        with self._cond:
            self._by_correlation[correlation] = device
        return correlation

    def offer(self, message: InboundMessage) -> None:
        """A reply to one of the requests, or a target's status; anything else is counted."""
        status_of = self._status_of.get(message.topic)
        if status_of is not None:
            self._status(status_of, message.payload)
            return
        with self._cond:
            device = self._by_correlation.get(message.correlation_data or b"")
        if device is None or message.topic != self.topics[device].cmd_reply(self.name):
            self.unmatched += 1  # another operator's reply, or a device answering for another
            return
        try:
            reply = decode(CommandReply, message.payload)
        except ProtocolError as exc:
            name = message.topic.rsplit("/", 1)[-1]
            reply = CommandReply(command=name, ok=False, error_code=exc.code, error=str(exc))
        with self._cond:
            first = is_running(reply) and device not in self.interim
            if is_running(reply):
                self.interim.setdefault(device, reply)
            else:
                self.replies.setdefault(device, reply)
            self._cond.notify_all()
        if first and self._on_running is not None:
            self._on_running(device, reply)

    def _status(self, device: str, payload: bytes) -> None:
        try:
            state = decode(StatusMessage, payload).state if payload else "unknown"
        except ProtocolError:
            state = "unknown"  # a status that does not parse says nothing: wait for the reply
        with self._cond:
            if state == "offline":
                self.offline.add(device)
            else:
                self.offline.discard(device)  # back online: its reply is awaited again
            self._cond.notify_all()

    def wait(self, timeout: float, follow_s: float = 0.0) -> bool:
        """Wait until every device replied or is offline; False when ``timeout`` ran out first. Devices
        that answered ``running`` in time are followed up to ``follow_s`` more for their final reply."""
        with self._cond:
            answered = self._cond.wait_for(lambda: all(self._heard(d) for d in self.devices), timeout)
            running = [d for d in self.interim if d not in self.replies]
            if not running:
                return answered
            return self._cond.wait_for(
                lambda: all(d in self.replies or d in self.offline for d in running), follow_s
            )

    def _heard(self, device: str) -> bool:
        """Answered (finally or ``running``) or offline; called with the condition held."""
        return device in self.replies or device in self.interim or device in self.offline

    def answers(self, timeout: float) -> dict[str, CommandReply | Unanswered]:
        """Each device's answer: its reply, else :class:`Unanswered` (``offline``, ``no_reply``)."""
        out: dict[str, CommandReply | Unanswered] = {}
        with self._cond:
            for device in self.devices:
                reply = self.replies.get(device) or self.interim.get(device)
                if reply is not None:
                    out[device] = reply
                elif device in self.offline:
                    out[device] = Unanswered(OFFLINE, offline_text(device))
                else:
                    out[device] = Unanswered(
                        NoReplyError.code,
                        f"no reply to command {self.name!r} from device {device!r} within {timeout:.0f}s",
                    )
        return out


@dataclass(frozen=True)
class Unanswered:
    """A device that sent no reply: offline by its retained status, or silent until the timeout."""

    code: str
    error: str


def answer_json(answer: CommandReply | Unanswered) -> dict[str, Any]:
    """One device's answer as ``fleet cmd`` prints it among the others."""
    if isinstance(answer, Unanswered):
        return {"ok": False, "error_code": answer.code, "error": answer.error}
    return answer.model_dump(mode="json", exclude_none=True)


def ask_devices(
    settings: MqttSettings,
    devices: Sequence[str],
    name: str,
    args: dict[str, Any] | None = None,
    *,
    timeout: float = 10.0,
    follow_s: float = 0.0,
    on_running: Callable[[str, CommandReply], None] | None = None,
) -> dict[str, CommandReply | Unanswered]:
    """Send command ``name`` to every one of ``devices`` at once; each one's answer, by device id
    (a ``running`` one followed up to ``follow_s`` seconds for its final reply; ``on_running`` is
    told of each such answer as it arrives).

    The status and reply subscriptions come first (a retained offline status arrives right after
    its SUBACK), then every request is published, then the replies are awaited together for at most
    ``timeout`` seconds: a device that does not answer costs the others nothing.
    """
    fan = FanOut(settings.prefix, devices, name, on_running)
    client = ServiceClient(settings, handler=fan.offer)
    client.start(timeout=min(timeout, 10.0))
    try:
        client.subscribe(fleet_filter(settings.prefix, "status"), qos=1, timeout=timeout)
        client.subscribe(fleet_filter(settings.prefix, "cmd"), qos=1, timeout=timeout)
        for device in fan.devices:
            publish_command(client, fan.topics[device], name, dict(args or {}), fan.expect(device))
        fan.wait(timeout, follow_s)
    finally:
        client.stop()
    return fan.answers(timeout)
