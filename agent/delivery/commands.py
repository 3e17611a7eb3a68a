"""Commands on ``down/cmd/{name}``, replies on ``up/cmd/{name}`` with the request's correlation data.

Handlers run on one worker thread of their own (a rollback loads a model: never on the MQTT
dispatcher thread). A reply also goes to the request's MQTT 5 response topic when that topic lies
inside this device's ``up/`` tree (an ACL would refuse anything else anyway, and a device must not
be made to publish on arbitrary topics).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog

from agent.errors import AgentError, TransportError
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.messages import CommandReply, CommandRequest, ProtocolError, decode
from agent.protocol.topics import Topics

log = structlog.get_logger(__name__)

#: ``handler(args) -> result``; raises an AgentError (its ``code`` is the reply's error_code).
CommandHandler = Callable[[dict[str, Any]], dict[str, Any]]

_QUEUE_SIZE = 32


class BadArgsError(AgentError):
    """A command's arguments are missing or of the wrong type."""

    code = "bad_args"


class CommandRouter:
    """The registry of commands and the thread that runs them."""

    def __init__(self, link: MqttLink, topics: Topics) -> None:
        self.link = link
        self.topics = topics
        self.handlers: dict[str, CommandHandler] = {}
        self._queue: queue.Queue[InboundMessage | None] = queue.Queue(_QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._up_prefix = f"{topics.prefix}/{topics.device_id}/up/"

    def register(self, name: str, handler: CommandHandler) -> None:
        """Serve command ``name`` with ``handler`` (replaces an earlier one of that name)."""
        self.handlers[name] = handler

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="delivery-commands", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def handle(self, message: InboundMessage) -> None:
        """Subscription handler (dispatcher thread): queue the request; a full queue is answered busy."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            name = message.topic.rsplit("/", 1)[-1]
            self._reply(
                message,
                CommandReply(
                    command=name, ok=False, error_code="busy", error="too many commands queued; retry later"
                ),
            )

    def _loop(self) -> None:
        while True:
            message = self._queue.get()
            if message is None:
                return
            try:
                self._serve(message)
            except Exception:  # a reply that cannot be built or sent must not end the loop
                log.exception("delivery.command.crashed", topic=message.topic)

    def _serve(self, message: InboundMessage) -> None:
        name = message.topic.rsplit("/", 1)[-1]
        try:
            request = decode(CommandRequest, message.payload or b"{}")
        except ProtocolError as exc:
            self._reply(message, CommandReply(command=name, ok=False, error_code=exc.code, error=str(exc)))
            return
        handler = self.handlers.get(name)
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            reply = CommandReply(
                command=name,
                ok=False,
                error_code="unknown_command",
                error=f"unknown command {name!r}; known: {known}",
            )
        else:
            try:
                reply = CommandReply(command=name, ok=True, result=handler(dict(request.args)))
            except AgentError as exc:
                reply = CommandReply(command=name, ok=False, error_code=exc.code, error=str(exc))
            except Exception as exc:
                log.exception("delivery.command.failed", command=name)
                reply = CommandReply(command=name, ok=False, error_code="internal_error", error=repr(exc))
        log.info("delivery.command", command=name, ok=reply.ok, error_code=reply.error_code)
        self._reply(message, reply)

    def _reply(self, message: InboundMessage, reply: CommandReply) -> None:
        props = PublishProperties(correlation_data=message.correlation_data)
        targets = [self.topics.cmd_reply(reply.command)]
        wanted = message.response_topic
        if wanted and wanted not in targets:
            if wanted.startswith(self._up_prefix) and not any(c in wanted for c in "+#\0"):
                targets.append(wanted)
            else:
                log.warning("delivery.command.response_topic_refused", response_topic=wanted)
        for topic in targets:
            try:
                self.link.publish(topic, reply, qos=1, properties=props)
            except TransportError as exc:
                log.error("delivery.command.reply_failed", topic=topic, error=str(exc))
                # Too large (a huge status): say so instead of staying silent.
                short = CommandReply(command=reply.command, ok=False, error_code=exc.code, error=str(exc))
                self.link.publish(topic, short, qos=1, properties=props)
