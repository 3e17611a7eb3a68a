"""The chunk protocol, device side: what a chunk request says, and replies routed to their transfer.

A device asks for chunks on ``up/xfer/req`` (:class:`ChunkRequest`); the chunk server answers each
index on the request's response topic ``down/xfer/{sha256}`` with user properties ``index`` and
``sha256`` (:data:`INDEX_PROPERTY`, :data:`SHA256_PROPERTY`). One :class:`ChunkRouter` per link hands
each reply to the running transfer of its model (:mod:`agent.delivery.transfer`).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from agent.errors import DeliveryError
from agent.model_base import StrictModel
from agent.mqtt.inbound import InboundMessage
from agent.protocol.topics import Topics, parse

if TYPE_CHECKING:
    from agent.mqtt.link import MqttLink

#: User property names on a chunk reply.
INDEX_PROPERTY = "index"
SHA256_PROPERTY = "sha256"
#: Most indices one request may name (a request never asks for more than the window anyway).
MAX_INDICES = 256


class ChunkRequest(StrictModel):
    """``up/xfer/req`` payload: please send these chunks of the model with this SHA-256.

    Published with MQTT 5 ResponseTopic ``{prefix}/{device}/down/xfer/{sha256}`` and CorrelationData
    (a request id the server echoes). ``chunk_size`` lets a server that has the file but not the
    manifest (``fleet serve --repo``) cut the chunks.
    """

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the whole model file.")
    indices: list[int] = Field(min_length=1, max_length=MAX_INDICES, description="Chunk indices wanted.")
    chunk_size: int | None = Field(None, gt=0, description="Chunk size of the device's manifest.")
    device: str | None = Field(None, description="Requesting device id (must match the topic's).")


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
