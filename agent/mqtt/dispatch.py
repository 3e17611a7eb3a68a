"""The device link's dispatcher: subscriptions, and one thread that calls their handlers in order.

Received messages wait in a bounded :class:`~agent.mqtt.inbound.Inbox` (filled by the paho core's
callback, which only offers); this thread takes them one at a time and calls every handler whose
filter matches, and ``on_connected`` after each (re)connect. A handler that raises is logged and
counted; it never stops the thread or reaches paho.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from agent.mqtt.core import topic_matches
from agent.mqtt.inbound import STOP, Connected, InboundMessage, Inbox

log = structlog.get_logger(__name__)

Handler = Callable[[InboundMessage], None]

#: Topics whose matching handlers are remembered, at most.
_MATCHED_KEPT = 256


@dataclass(frozen=True)
class Subscription:
    topic_filter: str
    handler: Handler
    qos: int


class Dispatcher:
    """Subscriptions and the ``mqtt-dispatch`` thread; ``on_error()`` is told of each handler failure."""

    def __init__(
        self,
        inbox: Inbox,
        *,
        on_connected: Callable[[int], None] | None,
        on_error: Callable[[], None],
    ) -> None:
        self.inbox = inbox
        self._on_connected = on_connected
        self._on_error = on_error
        self._subs: list[Subscription] = []
        # topic -> the handlers whose filters match it: a model's chunk replies all come on one topic,
        # and matching each filter per message was most of this thread's own work.
        self._matched: dict[str, tuple[Handler, ...]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, topic_filter: str, handler: Handler, qos: int) -> None:
        with self._lock:
            self._subs.append(Subscription(topic_filter, handler, qos))
            self._matched = {}

    def subscriptions(self) -> list[Subscription]:
        with self._lock:
            return list(self._subs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mqtt-dispatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self.inbox.put_control(STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while True:
            # No timeout: every message, the connect notice and stop() are items. An idle dispatcher
            # sleeps until one comes (it woke once a second for nothing: bench/fleetsim_idle.py).
            item = self.inbox.take(timeout=None)
            if item is None:
                continue
            if item is STOP:
                return
            if isinstance(item, Connected):
                if self._on_connected is not None:
                    self._call_guarded("on_connected", lambda s=item.session: self._on_connected(s))  # type: ignore[misc]
                continue
            if isinstance(item, InboundMessage):
                for handler in self._handlers(item.topic):
                    self._call_guarded(item.topic, lambda h=handler, m=item: h(m))  # type: ignore[misc]

    def _handlers(self, topic: str) -> tuple[Handler, ...]:
        """The handlers whose filters match ``topic``, in subscription order (remembered per topic)."""
        with self._lock:
            handlers = self._matched.get(topic)
            if handlers is None:
                handlers = tuple(s.handler for s in self._subs if topic_matches(s.topic_filter, topic))
                if len(self._matched) >= _MATCHED_KEPT:
                    self._matched = {}  # topics a device sees are few; a flood of others starts over
                self._matched[topic] = handlers
            return handlers

    def _call_guarded(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self._on_error()
            log.exception("mqtt.handler.failed", target=what, error=repr(exc))
