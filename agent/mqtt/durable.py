"""The device link's durable messages: stored in the spool before they are sent, sent by the network
thread within the broker's window, removed from the spool on PUBACK, replayed after reconnects and
restarts.

Two sides, one rule. Publisher threads only store messages (and wait, bounded, for the backlog to
fall); only the network thread publishes a durable message and takes its acknowledgement, so a
PUBACK (handled after the ``publish()`` call that produced its mid has returned) always finds its
spool id, even when the broker answered before ``publish()`` returned. Each method says which side
calls it; the network-thread state (the spool ids in flight by mid, the replay cursor, the
acknowledgements batched per turn of the loop) is touched by that thread only.

One job (the spool side of the link); the connection's life (connect, reconnect, events, status)
is :mod:`agent.mqtt.link`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import structlog
from pydantic import BaseModel

from agent.errors import TransportError
from agent.mqtt.core import MqttCore, PublishProperties
from agent.mqtt.events import PublishOutcome
from agent.mqtt.link_counters import LinkCounters
from agent.protocol.messages import encode
from agent.spool.queue import MessageKind, Spool, SpoolEntry, SpoolWriteError

log = structlog.get_logger(__name__)

#: While connected, durable publishers wait (at most this long per call) for the spool's backlog to
#: fall below a few windows: the frame path then runs at the rate the link can deliver (back-pressure
#: through the pipeline's drop policies) instead of filling the spool to its cap with the broker up.
_BACKLOG_WAIT_S = 1.0

#: How the link sends one message from paho's memory queue (QoS 1): ``(topic, payload, retain)``.
SendFromMemory = Callable[[str, bytes, bool], None]


class DurableMessages:
    """The link's durable messages, from the spool to the broker's PUBACK."""

    def __init__(
        self,
        spool: Spool,
        max_inflight: int,
        counters: LinkCounters,
        *,
        connected: Callable[[], bool],
        stopping: threading.Event,
        payload_limit: Callable[[str], int],
        send_from_memory: SendFromMemory,
        wake: Callable[[], None],
    ) -> None:
        self._spool = spool
        self._max_inflight = max_inflight
        self._counters = counters
        self._connected = connected
        self._stopping = stopping
        self._payload_limit = payload_limit
        self._send_from_memory = send_from_memory
        self._wake_loop = wake
        self._window = max_inflight
        # Network-thread state: spool id of each durable message in flight, by mid.
        self._inflight: dict[int, int] = {}
        self._cursor = 0
        # Spool ids acknowledged during this turn of the loop: deleted in one transaction (one fsync
        # per turn instead of one per PUBACK, which capped replay below the durable result rate).
        self._acked: list[int] = []
        self._backlog_limit = 4 * max_inflight
        self._room = threading.Event()  # set by the network thread after acknowledgements
        self._wake = threading.Event()

    # -- publisher threads ---------------------------------------------------------------------

    def publish(self, topic: str, data: bytes, retain: bool, kind: MessageKind) -> None:
        """Store one message (its size checked already) and have the network thread send it.

        ``kind`` picks its spool policy: a ``result`` may be dropped at the spool's cap or on a full
        disk while disconnected (counted) and expires; a ``state`` (job status) never is. When the
        spool cannot store it (full disk) while connected, it waits in paho's memory queue like a
        non-durable QoS 1 message instead (counted as ``spool_fallback_memory``); disconnected, a
        state raises TransportError (the caller holds it and publishes it again).
        """
        try:
            self._spool.add_many([SpoolEntry(topic, data, retain, kind)], raise_on_failure=self._connected())
        except SpoolWriteError as exc:
            if not self._connected():
                # Full disk, broker away: only a job state gets here (results are dropped and
                # counted by the spool). The caller holds it and offers it again, to the spool
                # once space returns (durable again) or to the link once connected.
                raise TransportError(
                    f"the spool cannot store {topic} ({exc}) and the broker is not connected; "
                    "hold it and publish it again"
                ) from exc
            # Full disk, broker there: out from paho's memory queue (QoS 1) rather than lost; the
            # spool warned once, no traceback per message.
            self._counters.count("spool_fallback_memory")
            self._send_from_memory(topic, data, retain)
            return
        self._spooled()

    def publish_many(
        self, messages: Sequence[tuple[str, bytes | BaseModel]], *, kind: MessageKind
    ) -> list[str | None]:
        """Store many messages in one transaction (one fsync for all), then have them sent.

        Returns, per message, None or why it was refused (a payload over the size limit: counted,
        never sent; the others go on). When the spool cannot write (full disk) while the link is
        connected, they are sent from memory (QoS 1, counted as ``spool_fallback_memory``).
        """
        entries = []
        refused: list[str | None] = []
        for topic, payload in messages:
            data = encode(payload) if isinstance(payload, BaseModel) else bytes(payload)
            limit = self._payload_limit(topic)
            if len(data) > limit:
                self._counters.count("refused_oversize")
                refused.append(
                    f"payload of {len(data)} bytes for {topic} exceeds the limit of {limit} bytes; "
                    "not sent: send less (truncate tensors) or raise mqtt.max_payload_bytes"
                )
                continue
            refused.append(None)
            entries.append(SpoolEntry(topic, data, False, kind))
        if not entries:
            return refused
        self._wait_for_backlog()
        try:
            # Connected, a full disk need not lose results: they go out from paho's memory queue
            # (bounded by max_queued) instead. Disconnected, the spool drops and counts them.
            self._spool.add_many(entries, raise_on_failure=self._connected())
        except SpoolWriteError:
            self._counters.count("spool_fallback_memory", len(entries))
            for entry in entries:
                self._send_from_memory(entry.topic, entry.payload, entry.retain)
            return refused
        self._spooled()
        return refused

    def _spooled(self) -> None:
        """Messages wait in the spool: the network thread sends them now, not at its next idle turn."""
        self._wake.set()
        self._wake_loop()

    def _wait_for_backlog(self) -> None:
        """Connected with a backlog of more than a few windows: wait (bounded) for the link to catch up.

        Not while disconnected: then the spool is the outage buffer, bounded by its caps.
        """
        deadline = time.monotonic() + _BACKLOG_WAIT_S
        while self._connected() and self._spool.count() > self._backlog_limit:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                return
            self._room.clear()
            self._room.wait(min(remaining, 0.05))

    # -- the network thread --------------------------------------------------------------------

    def in_flight(self, mid: int) -> bool:
        """Whether ``mid`` is a durable message waiting for its PUBACK."""
        return mid in self._inflight

    def connected(self, receive_max: int | None) -> None:
        """A connection was accepted: send within the broker's Receive Maximum, replay from the spool.

        paho ignores the broker's Receive Maximum (and cannot change its own limit while connected):
        keep at least our durable window within it."""
        self._window = min(self._max_inflight, receive_max or self._max_inflight)
        self._wake.set()

    def acknowledged(self, mid: int) -> int | None:
        """The broker answered ``mid`` (accepted or refused for good): its spool id, None when it was
        no durable message. The row is removed at :meth:`remove_acknowledged`."""
        spool_id = self._inflight.pop(mid, None)
        if spool_id is not None:
            self._acked.append(spool_id)
            self._wake.set()
        return spool_id

    def remove_acknowledged(self) -> None:
        """Delete this turn's acknowledged rows from the spool, in one transaction."""
        if self._acked:
            acked, self._acked = self._acked, []
            self._spool.remove_many(acked)
            self._room.set()

    def send(self, core: MqttCore) -> None:
        """Publish what waits in the spool, as far as the window has room."""
        if not self._wake.is_set():
            return
        free = self._window - len(self._inflight)
        if free <= 0:
            return  # a PUBACK sets the wake flag again
        self._wake.clear()
        batch = self._spool.pending(limit=free, after_id=self._cursor)
        for msg in batch:
            limit = self._payload_limit(msg.topic)
            if len(msg.payload) > limit:
                # Spooled before the broker's (smaller) limit was known: it can never be delivered.
                self._counters.count("refused_oversize")
                log.error("mqtt.spool.oversize_dropped", topic=msg.topic, size=len(msg.payload), limit=limit)
                self._spool.remove(msg.id)
                self._cursor = msg.id
                continue
            sent = core.publish(
                msg.topic, msg.payload, qos=1, retain=msg.retain, properties=_expiry(msg.expires_at)
            )
            if sent.outcome is PublishOutcome.QUEUE_FULL:
                self._wake.set()  # paho's queue is full of non-durable messages: try again later
                break
            # SUCCESS, or NO_CONN (connection just dropped): paho holds it and resends after reconnect.
            self._inflight[sent.mid] = msg.id
            self._cursor = msg.id
        self._spool.mark_sent(self._cursor)
        if len(batch) == free:
            self._wake.set()  # there may be more

    def drained(self) -> bool:
        """Nothing waits in the spool and nothing is in flight (a graceful stop may go on)."""
        return self._spool.count() == 0 and not self._inflight


def _expiry(expires_at: float | None) -> PublishProperties | None:
    """MQTT 5 Message Expiry Interval for a spooled message with a time-to-live (the broker then drops
    it for a subscriber that was offline longer than it is worth)."""
    if expires_at is None:
        return None
    return PublishProperties(message_expiry_s=max(1, math.ceil(expires_at - time.time())))
