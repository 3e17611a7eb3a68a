"""A read-mostly MQTT client for operator tools (demo, ``fleet status/watch``): subscribe and iterate.

Unlike :class:`agent.mqtt.link.MqttLink` it has no spool, no status topic and no Last Will: it is
a viewer, not a device. Messages arrive on a bounded queue; paho's callbacks only enqueue.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterable

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.errors import TransportError
from agent.mqtt.clients import new_client
from agent.mqtt.settings import MqttSettings

#: Arrived message as (topic, payload, retained).
Arrival = tuple[str, bytes, bool]


class Observer:
    """Subscribe to topic filters and read what arrives with :meth:`get`."""

    def __init__(
        self,
        settings: MqttSettings,
        filters: Iterable[str],
        *,
        client_id: str | None = None,
        maxsize: int = 10000,
    ) -> None:
        self._filters = list(filters)
        self._queue: queue.Queue[Arrival] = queue.Queue(maxsize)
        self.overflow = 0
        self._client = new_client(settings, client_id or f"observer-{uuid.uuid4().hex[:8]}")
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._settings = settings

    def _on_connect(
        self,
        client: mqtt.Client,
        _userdata: object,
        _flags: object,
        reason: ReasonCode,
        _properties: Properties | None,
    ) -> None:
        if not reason.is_failure:
            for topic_filter in self._filters:
                client.subscribe(topic_filter, qos=1)

    def _on_message(self, _client: mqtt.Client, _userdata: object, message: mqtt.MQTTMessage) -> None:
        try:
            self._queue.put_nowait((message.topic, bytes(message.payload), bool(message.retain)))
        except queue.Full:
            self.overflow += 1

    def start(self) -> Observer:
        try:
            self._client.connect(
                self._settings.host, self._settings.port, keepalive=self._settings.keepalive_s
            )
        except OSError as exc:
            raise TransportError(
                f"cannot reach the broker at {self._settings.host}:{self._settings.port}: {exc}"
            ) from exc
        self._client.loop_start()
        return self

    def get(self, timeout: float) -> Arrival | None:
        """The next message, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self._client.publish(topic, payload, qos=qos, retain=retain)

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
