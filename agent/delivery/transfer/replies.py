"""Chunk replies routed to their transfer: one :class:`ChunkRouter` per link hands each reply to the
running transfer of its model (:mod:`agent.delivery.transfer.pull`); the messages are in
:mod:`agent.protocol.chunks`.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

from agent.errors import DeliveryError
from agent.mqtt.inbound import InboundMessage
from agent.protocol.topics import Topics

if TYPE_CHECKING:
    from agent.mqtt.link import MqttLink

# -- routing replies to the running transfer ---------------------------------------------------------


class ChunkReply(NamedTuple):
    """A received chunk reply and the SHA-256 of its payload (hashed on the dispatcher thread)."""

    message: InboundMessage
    digest: str


class ReplyQueue:
    """The replies of one transfer, oldest first, at most ``maxsize`` (``offer`` refuses beyond).

    One per chunk reply crosses it, so it is a :class:`queue.SimpleQueue` (its lock is C's; a
    ``queue.Queue`` builds a Python lock per wait): the bound is kept by who offers, which is only
    the router. ``None`` is a wake-up, never refused.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: queue.SimpleQueue[ChunkReply | None] = queue.SimpleQueue()

    def offer(self, reply: ChunkReply) -> bool:
        """Append ``reply``; False (nothing stored) when ``maxsize`` items are waiting."""
        if self._items.qsize() >= self.maxsize:
            return False
        self._items.put(reply)
        return True

    def wake(self) -> None:
        """Wake the transfer waiting in :meth:`get` (a flush ended)."""
        self._items.put(None)

    def get(self, timeout: float | None = None) -> ChunkReply | None:
        """The oldest item, waiting up to ``timeout`` s; raises queue.Empty when none came."""
        return self._items.get(timeout=timeout)

    def get_nowait(self) -> ChunkReply | None:
        """The oldest item; raises queue.Empty when none waits."""
        return self._items.get_nowait()

    def qsize(self) -> int:
        return self._items.qsize()


class ChunkRouter:
    """Subscribes once to ``down/xfer/+`` on a link and hands each reply to the transfer of its model.

    The link has no unsubscribe, so there is one router per link (:func:`router_for`). The handler
    runs on the link's dispatcher thread: it hashes the payload there (hashlib releases the GIL),
    which overlaps hashing with the transfer thread's writes and fsyncs, and enqueues.
    """

    def __init__(self, link: MqttLink, topics: Topics) -> None:
        # Every topic the subscription delivers is this, then the model's SHA-256.
        self._head = topics.xfer_filter[:-1]
        self._routes: dict[str, ReplyQueue] = {}
        self._lock = threading.Lock()
        self.unrouted = 0
        self.overflow = 0
        link.subscribe(topics.xfer_filter, self._on_message)

    def attach(self, sha256: str, maxsize: int) -> ReplyQueue:
        """Start routing replies for ``sha256`` to a new bounded queue; one transfer per model at a time."""
        with self._lock:
            if sha256 in self._routes:
                raise DeliveryError(
                    f"a transfer of model {sha256} is already running in this agent; wait for it to end"
                )
            q = ReplyQueue(maxsize)
            self._routes[sha256] = q
            return q

    def detach(self, sha256: str) -> None:
        """Stop routing ``sha256``; later replies are counted as unrouted and dropped."""
        with self._lock:
            self._routes.pop(sha256, None)

    def _on_message(self, message: InboundMessage) -> None:
        topic = message.topic
        sha = topic[len(self._head) :] if topic.startswith(self._head) else ""
        q = self._routes.get(sha)  # one dict read: atomic, and attach/detach swap whole entries
        if q is None:
            self.unrouted += 1  # a late reply of a finished or killed transfer
            return
        if not q.offer(ChunkReply(message, hashlib.sha256(message.payload).hexdigest())):
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
