"""Received messages and the bounded inbox between paho's callbacks and the dispatcher thread."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class InboundMessage:
    """One message received from the broker, with its MQTT 5 request/response properties."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class InboxFull:
    """A received message was dropped: the inbox was full (the link's network thread counts and logs it)."""

    topic: str


@dataclass(frozen=True)
class Connected:
    """Control item: the link (re)connected with this session number."""

    session: int


class _Stop:
    """Control item: the dispatcher should exit."""


STOP = _Stop()

InboxItem = InboundMessage | Connected | _Stop


class Inbox:
    """FIFO of received messages (bounded: ``offer`` refuses when full) and control items (never refused).

    ``offer`` is what paho's ``on_message`` calls: it only appends under a short lock and never blocks.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: collections.deque[InboxItem] = collections.deque()
        self._messages = 0
        self._cond = threading.Condition()

    def offer(self, message: InboundMessage) -> bool:
        """Append a received message; False (nothing stored) when ``maxsize`` messages are waiting."""
        with self._cond:
            if self._messages >= self.maxsize:
                return False
            self._items.append(message)
            self._messages += 1
            self._cond.notify()
            return True

    def put_control(self, item: Connected | _Stop) -> None:
        """Append a control item; never refused."""
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def take(self, timeout: float | None) -> InboxItem | None:
        """The oldest item, or None after ``timeout`` seconds (None: wait until there is one)."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout):
                return None
            item = self._items.popleft()
            if isinstance(item, InboundMessage):
                self._messages -= 1
            return item

    def __len__(self) -> int:
        with self._cond:
            return self._messages
