"""A read-mostly MQTT viewer for operator tools (demo, benchmarks): subscribe, then iterate.

Unlike :class:`agent.mqtt.link.MqttLink` it has no spool, no status topic and no Last Will: it is
a viewer, not a device. It is a :class:`~agent.mqtt.service_client.ServiceClient` whose handler puts
every message on a bounded queue that :meth:`Observer.get` reads.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterable

from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
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
        self._client = ServiceClient(
            settings, client_id=client_id or f"observer-{uuid.uuid4().hex[:8]}", handler=self._on_message
        )

    def _on_message(self, message: InboundMessage) -> None:
        try:
            self._queue.put_nowait((message.topic, message.payload, message.retain))
        except queue.Full:
            self.overflow += 1

    def start(self, timeout: float = 10.0) -> Observer:
        """Connect and subscribe; TransportError when the broker cannot be reached in ``timeout``."""
        self._client.start(timeout)
        for topic_filter in self._filters:
            self._client.subscribe(topic_filter, qos=1)
        return self

    def get(self, timeout: float) -> Arrival | None:
        """The next message, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._client.stop()
