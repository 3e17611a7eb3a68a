"""The device's side of the engines conversation with the controller: one request, one reply.

A request goes on ``{prefix}/{device}/up/engines/{verb}`` with the MQTT 5 response topic
``{prefix}/{device}/down/engines/reply`` and a fresh correlation id; the controller answers there
with a :class:`~agent.protocol.messages.CommandReply` (docs/protocol.md). A reply nobody waits for
any more (it came after the bounded wait) is dropped. The paho callback only completes a waiting
request (STYLE: callbacks only enqueue).
"""

from __future__ import annotations

import threading
import uuid
from typing import Protocol

import structlog
from pydantic import BaseModel

from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.messages import CommandReply, JobStatus, ProtocolError, decode
from agent.protocol.topics import Topics

log = structlog.get_logger(__name__)

#: Requests waiting for their reply at once (one build asks at a time; an upload sends one piece).
_MAX_WAITING = 8


class EngineRequests(Protocol):
    """What the fleet engine cache needs from the broker: ask and wait (bounded) for the reply."""

    def request(
        self,
        verb: str,
        payload: bytes | BaseModel,
        timeout_s: float,
        user_properties: dict[str, str] | None = None,
    ) -> CommandReply | None:
        """The controller's reply, or None when none came within ``timeout_s``."""
        ...

    def job_status(self, status: JobStatus) -> None:
        """Publish a start-up job's status on ``up/jobs/{job_id}`` (the evidence an offer names)."""
        ...


class MqttEngineRequests:
    """:class:`EngineRequests` over the device's MQTT link."""

    def __init__(self, link: MqttLink, topics: Topics) -> None:
        self._link = link
        self._topics = topics
        self._lock = threading.Lock()
        self._waiting: dict[bytes, tuple[threading.Event, list[CommandReply]]] = {}
        self._subscribed = False

    def _subscribe_once(self) -> None:
        with self._lock:
            if self._subscribed:
                return
            self._subscribed = True
        self._link.subscribe(self._topics.engines_reply, self._on_reply, 1)

    def _on_reply(self, message: InboundMessage) -> None:
        with self._lock:
            waiting = self._waiting.get(message.correlation_data or b"")
        if waiting is None:
            return  # late: its request gave up waiting
        try:
            reply = decode(CommandReply, message.payload)
        except ProtocolError as exc:
            log.warning("engine.fleet.bad_reply", error=str(exc)[:300])
            return
        event, box = waiting
        box.append(reply)
        event.set()

    def job_status(self, status: JobStatus) -> None:
        # Spooled, QoS 1, as a deployment job's states: the controller's view must hear it.
        self._link.publish(self._topics.jobs(status.job_id), status, qos=1, durable=True)

    def request(
        self,
        verb: str,
        payload: bytes | BaseModel,
        timeout_s: float,
        user_properties: dict[str, str] | None = None,
    ) -> CommandReply | None:
        self._subscribe_once()
        correlation = uuid.uuid4().hex.encode()
        event = threading.Event()
        box: list[CommandReply] = []
        with self._lock:
            if len(self._waiting) >= _MAX_WAITING:
                log.warning("engine.fleet.too_many_requests", verb=verb)
                return None
            self._waiting[correlation] = (event, box)
        try:
            properties = PublishProperties(
                response_topic=self._topics.engines_reply,
                correlation_data=correlation,
                user_properties=tuple((user_properties or {}).items()),
            )
            self._link.publish(self._topics.engines_request(verb), payload, qos=1, properties=properties)
            event.wait(timeout_s)
            return box[0] if box else None
        finally:
            with self._lock:
                self._waiting.pop(correlation, None)
