"""Chunk replies routed to their transfer: one :class:`ChunkRouter` per link hands each reply to the
running transfer of its model (:mod:`agent.delivery.transfer.pull`); the messages are in
:mod:`agent.protocol.chunks`.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.errors import DeliveryError
from agent.mqtt.inbound import InboundMessage
from agent.protocol.topics import Topics, parse

if TYPE_CHECKING:
    from agent.mqtt.link import MqttLink

# -- routing replies to the running transfer ---------------------------------------------------------


@dataclass(frozen=True)
class ChunkReply:
    """A received chunk reply and the SHA-256 of its payload (hashed on the dispatcher thread)."""

    message: InboundMessage
    digest: str


class ChunkRouter:
    """Subscribes once to ``down/xfer/+`` on a link and hands each reply to the transfer of its model.

    The link has no unsubscribe, so there is one router per link (:func:`router_for`). The handler
    runs on the link's dispatcher thread: it hashes the payload there (hashlib releases the GIL),
    which overlaps hashing with the transfer thread's writes and fsyncs, and enqueues.
    """

    def __init__(self, link: MqttLink, topics: Topics) -> None:
        self._topics = topics
        self._routes: dict[str, queue.Queue[ChunkReply | None]] = {}
        self._lock = threading.Lock()
        self.unrouted = 0
        self.overflow = 0
        link.subscribe(topics.xfer_filter, self._on_message)

    def attach(self, sha256: str, maxsize: int) -> queue.Queue[ChunkReply | None]:
        """Start routing replies for ``sha256`` to a new bounded queue; one transfer per model at a time.

        The transfer may put None into the queue itself, to wake its loop.
        """
        with self._lock:
            if sha256 in self._routes:
                raise DeliveryError(
                    f"a transfer of model {sha256} is already running in this agent; wait for it to end"
                )
            q: queue.Queue[ChunkReply | None] = queue.Queue(maxsize)
            self._routes[sha256] = q
            return q

    def detach(self, sha256: str) -> None:
        """Stop routing ``sha256``; later replies are counted as unrouted and dropped."""
        with self._lock:
            self._routes.pop(sha256, None)

    def _on_message(self, message: InboundMessage) -> None:
        try:
            sha = parse(message.topic, self._topics.prefix).arg or ""
        except ValueError:
            sha = ""
        with self._lock:
            q = self._routes.get(sha)
        if q is None:
            self.unrouted += 1  # a late reply of a finished or killed transfer
            return
        try:
            q.put_nowait(ChunkReply(message, hashlib.sha256(message.payload).hexdigest()))
        except queue.Full:
            self.overflow += 1  # asked again on timeout


_ROUTERS: weakref.WeakKeyDictionary[MqttLink, ChunkRouter] = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


def router_for(link: MqttLink, topics: Topics) -> ChunkRouter:
    """The link's chunk router, subscribing on first use."""
    with _ROUTERS_LOCK:
        router = _ROUTERS.get(link)
        if router is None:
            router = ChunkRouter(link, topics)
            _ROUTERS[link] = router
        return router
