"""The CLI's side of the controller API: a request, its reply (matched by correlation data), uploads."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import AgentError, TransportError
from agent.fleet.controller.requests import ModelNotUploadedError
from agent.fleet.controller.upload import PIECE_SIZE
from agent.fleet.devices.command import PendingReplies
from agent.mqtt.core import PublishProperties
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.topics import ControllerTopics

#: MQTT 5 PUBACK reason code: the broker took the message but no client subscribes to its topic.
NO_MATCHING_SUBSCRIBERS = 0x10
#: Seconds to wait for the controller's reply to one request (a start reads the fleet first).
DEFAULT_REQUEST_TIMEOUT_S = 30.0


class ControllerUnavailableError(TransportError):
    """No controller answered (not running, another prefix, or the broker's ACL drops the request)."""

    code = "no_controller"


class RequestRefusedError(AgentError):
    """The controller answered with an error; ``code`` is its error code."""

    def __init__(self, verb: str, code: str | None, error: str | None) -> None:
        super().__init__(f"controller refused {verb}: {error or code}")
        self.code = code or "refused"
        self.reason = error or ""


class ControllerClient:
    """A connection to the broker that talks to the controller (``with`` starts and stops it)."""

    def __init__(self, settings: MqttSettings, *, timeout: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.topics = ControllerTopics(settings.prefix)
        self.timeout = timeout
        self._reply_topic = self.topics.reply(uuid.uuid4().hex)
        self._pending = PendingReplies()
        self._client = ServiceClient(settings, handler=self._pending.offer)

    def __enter__(self) -> ControllerClient:
        self._client.start(min(self.timeout, 10.0))
        self._client.subscribe(self._reply_topic, qos=1, timeout=self.timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.stop()

    def request(
        self,
        verb: str,
        args: dict[str, Any] | None = None,
        *,
        payload: bytes | None = None,
        user_properties: tuple[tuple[str, str], ...] = (),
    ) -> dict[str, Any]:
        """Send one request; its result, or RequestRefusedError / ControllerUnavailableError."""
        correlation = self._pending.expect()
        properties = PublishProperties(
            response_topic=self._reply_topic, correlation_data=correlation, user_properties=user_properties
        )
        body = payload if payload is not None else json.dumps(args or {}).encode()
        topic = self.topics.request(verb)
        deadline = time.monotonic() + self.timeout
        mid = self._client.publish(topic, body, qos=1, properties=properties)
        self._check_routed(topic, self._client.ack_code(mid, self.timeout))
        reply = self._pending.wait(correlation, max(0.0, deadline - time.monotonic()))
        if reply is None:
            raise ControllerUnavailableError(
                f"no controller answered {verb} on {self.topics.request(verb)} within {self.timeout:.0f}s; "
                "is `edge-agent fleet controller` running against this broker and prefix?"
            )
        if not reply.ok:
            raise RequestRefusedError(verb, reply.error_code, reply.error)
        return reply.result or {}

    def _check_routed(self, topic: str, code: int | None) -> None:
        """Fail at once, not after the whole timeout, when the broker said nobody subscribes to the
        request topic (no controller runs under this prefix) or refused the request (its ACL)."""
        if code == NO_MATCHING_SUBSCRIBERS:
            raise ControllerUnavailableError(
                f"no controller listens on {topic} (the broker has no subscriber there): is `edge-agent "
                f"fleet controller` running against this broker, with prefix {self.topics.prefix}?"
            )
        if code is not None and code >= 0x80:
            raise ControllerUnavailableError(
                f"the broker refused the request on {topic} (MQTT reason code {code:#04x}); may this "
                f"account publish on {self.topics.prefix}/_controller/req/# (the broker's ACL)?"
            )

    def start(
        self, body: dict[str, Any], model: Path, on_upload: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Ask the controller to start the rollout ``body`` describes; the rollout's status.

        Asked once; only when the controller answers that its repository lacks the model (by error
        code, never by the words of the error) is ``model`` uploaded (``on_upload`` called first) and
        the start asked again.
        """
        try:
            return self.request("start", body)
        except RequestRefusedError as exc:
            if exc.code != ModelNotUploadedError.code:
                raise
        if on_upload is not None:
            on_upload()
        self.upload(model, str(body["model_sha256"]))
        return self.request("start", body)

    def upload(self, path: Path, sha256: str, on_piece: Callable[[int, int], None] | None = None) -> None:
        """Send ``path`` to the controller's repository in pieces (nothing if it has it already)."""
        size = path.stat().st_size
        offset = 0
        with path.open("rb") as f:
            while True:
                f.seek(offset)
                data = f.read(PIECE_SIZE)
                props = (("sha256", sha256), ("offset", str(offset)), ("size", str(size)))
                result = self.request("upload", payload=data, user_properties=props)
                if result.get("complete"):
                    return
                offset = int(result["have"])
                if on_piece is not None:
                    on_piece(offset, size)
