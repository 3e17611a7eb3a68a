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
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import structlog
from pydantic import BaseModel, ValidationError

from agent.errors import AgentError, TransportError
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.messages import CommandReply, CommandRequest, ProtocolError, decode
from agent.protocol.topics import Topics, check_level

log = structlog.get_logger(__name__)

#: ``handler(args) -> result`` (or :class:`Followed` for work that goes on); raises an AgentError
#: (its ``code`` is the reply's error_code).
CommandHandler = Callable[[dict[str, Any]], "dict[str, Any] | Followed"]

ArgsT = TypeVar("ArgsT", bound=BaseModel)

_QUEUE_SIZE = 32
#: Longest argument value quoted back in a ``bad_args`` reply.
_SHOWN_INPUT = 60


class BadArgsError(AgentError):
    """A command's arguments are missing, unknown or of the wrong type."""

    code = "bad_args"


class NoSuchSlotError(AgentError):
    """A command names a model slot the device does not have."""

    code = "wrong_slot"


@dataclass(frozen=True)
class Followed:
    """A handler's answer for work that goes on (a rollback that rebuilds an engine): ``interim`` is
    replied at once, ``ok: true`` with ``state: running``; the final reply, with the same correlation
    data, once ``done`` resolves (its result, or its error as any handler's)."""

    interim: dict[str, Any]
    done: Future[dict[str, Any]]


@dataclass(frozen=True)
class _Command:
    handler: Callable[[Any], dict[str, Any] | Followed]
    args: type[BaseModel] | None
    quiet: bool = False


class CommandRouter:
    """The registry of commands and the thread that runs them."""

    def __init__(self, link: MqttLink, topics: Topics) -> None:
        self.link = link
        self.topics = topics
        self.handlers: dict[str, _Command] = {}
        self._counts = {"served": 0, "failed": 0, "refused": 0, "busy": 0}
        self._counts_lock = threading.Lock()
        self._queue: queue.Queue[InboundMessage | None] = queue.Queue(_QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._up_prefix = f"{topics.prefix}/{topics.device_id}/up/"

    @overload
    def register(
        self,
        name: str,
        handler: Callable[[ArgsT], dict[str, Any] | Followed],
        args: type[ArgsT],
        *,
        quiet: bool = False,
    ) -> None: ...
    @overload
    def register(
        self, name: str, handler: CommandHandler, args: None = None, *, quiet: bool = False
    ) -> None: ...

    def register(
        self,
        name: str,
        handler: Callable[[Any], dict[str, Any] | Followed],
        args: type[BaseModel] | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Serve command ``name`` with ``handler`` (replaces an earlier one of that name).

        With ``args`` (a model of the command's arguments), the request's args are validated first and
        the handler gets the model; a mismatch is answered ``bad_args`` naming the argument. Without
        it, the handler gets the args as a dict and checks them itself. ``quiet``: a call it served
        is counted but not logged (``logs``: reading the log must not write to it at each poll).
        """
        self.handlers[name] = _Command(handler, args, quiet)

    def stats(self) -> dict[str, float]:
        """Commands served (ok), failed (the handler raised), refused (bad request) and busy, since start."""
        with self._counts_lock:
            return {k: float(v) for k, v in self._counts.items()}

    def _count(self, what: str) -> None:
        with self._counts_lock:
            self._counts[what] += 1

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
            self._count("busy")
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
            check_level(name, "command name")
        except ValueError as exc:
            # ``down/cmd/`` matches ``down/cmd/+`` with an empty level; there is no ``up/cmd/`` to
            # answer on, so only a valid response topic hears back.
            self._refuse(
                message,
                CommandReply(
                    command=name,
                    ok=False,
                    error_code="unknown_command",
                    error=f"{exc}: publish commands on down/cmd/{{name}}",
                ),
            )
            return
        try:
            request = decode(CommandRequest, message.payload or b"{}")
        except ProtocolError as exc:
            self._refuse(message, CommandReply(command=name, ok=False, error_code=exc.code, error=str(exc)))
            return
        command = self.handlers.get(name)
        if command is None:
            known = ", ".join(sorted(self.handlers))
            error = f"unknown command {name!r}; known: {known}"
            self._refuse(
                message, CommandReply(command=name, ok=False, error_code="unknown_command", error=error)
            )
            return
        args: Any = dict(request.args)
        if command.args is not None:
            try:
                args = command.args.model_validate(request.args)
            except ValidationError as exc:
                error = bad_args_text(name, command.args, exc)
                self._refuse(
                    message, CommandReply(command=name, ok=False, error_code=BadArgsError.code, error=error)
                )
                return
        try:
            result = command.handler(args)
        except Exception as exc:  # noqa: BLE001 (answered: internal_error, logged with its traceback)
            self._answer(message, name, None, exc, quiet=command.quiet)
            return
        if isinstance(result, Followed):
            interim = CommandReply(command=name, ok=True, result={**result.interim, "state": "running"})
            log.info("delivery.command.running", command=name)
            self._reply(message, interim)
            # The final reply from the thread that ends the work (or at once, when it has ended).
            result.done.add_done_callback(
                lambda done: self._answer(message, name, *_outcome(done), quiet=command.quiet)
            )
            return
        self._answer(message, name, result, None, quiet=command.quiet)

    def _answer(
        self,
        message: InboundMessage,
        name: str,
        result: dict[str, Any] | None,
        error: BaseException | None,
        *,
        quiet: bool,
    ) -> None:
        """The reply to a handler's ``result``, or to the ``error`` it raised (``quiet``: a served
        call is not logged)."""
        if error is None:
            reply = CommandReply(command=name, ok=True, result=result)
        elif isinstance(error, AgentError):
            reply = CommandReply(command=name, ok=False, error_code=error.code, error=str(error))
        else:
            log.error("delivery.command.failed", command=name, error=repr(error), exc_info=error)
            reply = CommandReply(command=name, ok=False, error_code="internal_error", error=repr(error))
        self._count("served" if reply.ok else "failed")
        if not (reply.ok and quiet):
            log.info("delivery.command", command=name, ok=reply.ok, error_code=reply.error_code)
        self._reply(message, reply)

    def _refuse(self, message: InboundMessage, reply: CommandReply) -> None:
        """A request that never reached a handler: counted, logged on one line, answered."""
        self._count("refused")
        log.warning(
            "delivery.command.refused", topic=message.topic, error_code=reply.error_code, error=reply.error
        )
        self._reply(message, reply)

    def _reply(self, message: InboundMessage, reply: CommandReply) -> None:
        props = PublishProperties(correlation_data=message.correlation_data)
        try:
            targets = [self.topics.cmd_reply(reply.command)]
        except ValueError:
            targets = []  # no valid command name: nothing to answer on but a response topic
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


def _outcome(done: Future[dict[str, Any]]) -> tuple[dict[str, Any] | None, BaseException | None]:
    error = done.exception()
    return (None, error) if error is not None else (done.result(), None)


def bad_args_text(command: str, model: type[BaseModel], exc: ValidationError) -> str:
    """One line naming each wrong argument of ``command``, and the arguments it takes."""
    problems = []
    for error in exc.errors(include_url=False):
        arg = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown argument {arg!r}")
        elif error["type"] == "missing":
            problems.append(f"argument {arg!r} is missing")
        elif not arg:
            problems.append(f"args must be a JSON object ({error['msg']})")
        else:
            shown = repr(error["input"])
            if len(shown) > _SHOWN_INPUT:
                shown = shown[:_SHOWN_INPUT] + "..."
            problems.append(f"argument {arg!r}: {error['msg']}, got {shown}")
    takes = ", ".join(model.model_fields) or "no arguments"
    return f"{command}: {'; '.join(problems)} ({command} takes: {takes})"
