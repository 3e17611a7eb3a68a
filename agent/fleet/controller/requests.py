"""The controller's request/reply API over the broker: one request answered with a
:class:`~agent.protocol.messages.CommandReply`, whatever it raised (docs/protocol.md, "The fleet controller").

A verb the controller does not know gets an ``unknown_verb`` reply rather than leaving the caller to
time out; a refusal (:class:`ControllerError` and the other :class:`~agent.errors.AgentError`), a
request that does not validate (``bad_request``), a move the rollout's state forbids
(``wrong_state``) and a bug (``internal_error``) each get their own error code. What each verb does
is :meth:`~agent.fleet.controller.process.FleetController.handle`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import structlog
from pydantic import ValidationError

from agent.errors import AgentError
from agent.fleet.base.untrusted import shown
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.protocol.messages import CommandReply, encode
from agent.protocol.topics import CONTROLLER_VERBS, ControllerTopics
from agent.transitions import IllegalTransitionError

log = structlog.get_logger(__name__)

Handler = Callable[[str, InboundMessage], dict[str, Any]]


class ControllerError(AgentError):
    """A request the controller refuses (bad id, wrong state, model missing)."""

    code = "controller"


class ModelNotUploadedError(ControllerError):
    """A ``start`` names a model the controller's repository lacks: the caller uploads it and asks again."""

    code = "model_not_uploaded"


def answer_request(
    message: InboundMessage, topics: ControllerTopics, handle: Handler, client: ServiceClient
) -> None:
    """Answer one request on its response topic: ``handle``'s result, or the error it raised."""
    asked = topics.requested(message.topic)
    if asked is None or message.response_topic is None:
        return  # not a request, or nobody to answer
    verb = topics.verb(message.topic)
    properties = PublishProperties(correlation_data=message.correlation_data)
    if verb is None:  # a typo or a newer CLI: say so rather than leave the caller to time out
        name = shown(asked, 64)
        unknown = CommandReply(
            command=name,
            ok=False,
            error_code="unknown_verb",
            error=f"unknown controller verb {name}; known: {', '.join(CONTROLLER_VERBS)}",
        )
        client.publish(message.response_topic, encode(unknown), qos=1, properties=properties)
        return
    try:
        result = handle(verb, message)
        reply = CommandReply(command=verb, ok=True, result=result)
    except (AgentError, ValueError) as exc:
        code = exc.code if isinstance(exc, AgentError) else "bad_request"
        reply = CommandReply(command=verb, ok=False, error_code=code, error=str(exc))
        log.warning("fleet.controller.refused", verb=verb, error=str(exc))
    except IllegalTransitionError as exc:
        reply = CommandReply(command=verb, ok=False, error_code="wrong_state", error=str(exc))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        reply = CommandReply(command=verb, ok=False, error_code="bad_request", error=problems)
    except Exception as exc:  # the loop must outlive any one request; the reply says what broke
        log.exception("fleet.controller.request_failed", verb=verb)
        reply = CommandReply(command=verb, ok=False, error_code="internal_error", error=repr(exc))
    client.publish(message.response_topic, encode(reply), qos=1, properties=properties)


def json_object(payload: bytes) -> dict[str, Any]:
    """A request's arguments: a JSON object ({} for an empty payload); ValueError otherwise."""
    if not payload:
        return {}
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"request is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("request must be a JSON object")  # noqa: TRY004 (a bad request, answered as such)
    return value
