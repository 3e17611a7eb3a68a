"""The MQTT link of a device: one :class:`~agent.mqtt.core.MqttCore`, driven by our own network thread.

Why it is built this way (each point is a paho 2.x or mosquitto trap, see docs/protocol.md; the
paho side of each lives in :mod:`agent.mqtt.core`, the only module that imports paho):

* Our thread runs the core's loop and does every socket read and write: publishes from other
  threads only queue a packet (the core is a ``single_writer``) and wake the loop through paho's
  socket pair. paho writes one wake byte per publish; the core's ``CoalescedWake`` writes one per
  turn of the loop (results at 800 fps cost the loop ~0.1 ms of CPU per wake-up on two cores).
  paho reports no QoS 0 write to the core (its report built two objects per result on this
  thread): a QoS 0 message counts as ``published`` when queued while connected.
* We reconnect ourselves with jittered exponential backoff; paho's ``reconnect_delay_set`` has no
  jitter and a fleet would reconnect in lockstep.
* The core's events only go into ``_events`` (messages into the inbox): taking our own lock in
  ``on_publish`` could deadlock against paho's (paho#226). The network thread handles the events
  after each turn of the loop.
* Durable messages are published only by the network thread, so a PUBACK (handled after the
  ``publish()`` call that produced its mid has returned) always finds its spool id, even when the
  broker answered before ``publish()`` returned.
* paho ignores the broker's Maximum Packet Size and resends an oversized QoS 1 message forever
  (paho#760): sizes are checked here, against our limit and the broker's CONNACK limit.

One job, about 600 lines: the network thread's state (connection, session, the durable window and
its spool ids in flight, the acknowledgements batched per turn, the offline status at stop) is one
state machine that only that thread touches; split across modules, the rule "only the network
thread publishes durable messages" would hold in no one place. The dispatcher is its own module.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog
from pydantic import BaseModel

from agent.backoff import reconnect_delay
from agent.errors import TransportError
from agent.mqtt.core import NOT_AUTHORIZED, MqttCore, PublishProperties, payload_limit
from agent.mqtt.dispatch import Dispatcher, Handler
from agent.mqtt.events import CallbackFailed, ConnAck, Disconnected, Event, PubAck, PublishOutcome, SubAck
from agent.mqtt.inbound import Connected, InboundMessage, Inbox
from agent.mqtt.session import SESSION_KEY, SessionCounter
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import StatusMessage, encode
from agent.spool import MessageKind, Spool, SpoolEntry, SpoolWriteError

log = structlog.get_logger(__name__)

__all__ = ["SESSION_KEY", "MqttLink", "PublishProperties"]
#: Longest one turn of the network loop waits on the socket. What another thread asks of the loop
#: (a publish, a spooled message to send, stop) wakes it at once through paho's socket pair, so this
#: only paces housekeeping (keepalive): idle, a link costs 2 turns a second, not 20 (1,000 simulated
#: devices on two cores: 1.2 cores idle at 20, 0.3 at 2; bench/fleetsim_idle.py).
_IDLE_LOOP_S = 0.5
#: While stopping, the stop's deadlines are checked this often.
_STOP_LOOP_S = 0.05
#: While connected, durable publishers wait (at most this long per call) for the spool's backlog to
#: fall below a few windows: the frame path then runs at the rate the link can deliver (back-pressure
#: through the pipeline's drop policies) instead of filling the spool to its cap with the broker up.
_BACKLOG_WAIT_S = 1.0
_COUNTERS = (
    "published",
    "dropped_offline",
    "dropped_queue_full",
    "refused_oversize",
    "acl_denied",
    "broker_refused",
    "callback_errors",
    "handler_errors",
    "reconnects",
    "connect_failures",
    "inbox_dropped",
    "spool_fallback_memory",
)


@dataclass(frozen=True)
class _InboxFull:
    """A received message was dropped: the inbox was full (counted and logged by the network thread)."""

    topic: str


class MqttLink:
    """A resilient MQTT 5 connection for one device: status with Last Will, durable publishes, dispatch.

    Threads: ``mqtt-network`` (all socket I/O, reconnects, spool replay, acks) and ``mqtt-dispatch``
    (calls subscription handlers and ``on_connected`` one at a time).
    """

    def __init__(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        status_topic: str,
        agent_version: str,
        spool: Spool,
        on_connected: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.status_topic = status_topic
        self.agent_version = agent_version
        self._spool = spool
        self._rng = random.Random()

        self._events: queue.SimpleQueue[Event | _InboxFull] = queue.SimpleQueue()
        self._inbox = Inbox(settings.inbox_size)
        self._dispatcher = Dispatcher(
            self._inbox, on_connected=on_connected, on_error=lambda: self._count("handler_errors")
        )
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts_lock = threading.Lock()

        self._connected = False
        self._connected_event = threading.Event()  # mirrors _connected, for wait_connected()
        self._ever_connected = False
        self._denied_run = 0  # refusals (0x87) since the last accepted QoS 1 publish or connect
        self._session = 0
        self._sessions = SessionCounter(spool)
        self._broker_max_packet: int | None = None
        self._window = settings.max_inflight
        # Network-thread state: spool id of each durable message in flight, by mid.
        self._durable_inflight: dict[int, int] = {}
        self._spool_cursor = 0
        # Spool ids acknowledged during this turn of the loop: deleted in one transaction (one fsync
        # per turn instead of one per PUBACK, which capped replay below the durable result rate).
        self._acked: list[int] = []
        self._backlog_limit = 4 * settings.max_inflight
        self._spool_room = threading.Event()  # set by the network thread after acknowledgements
        self._spool_wake = threading.Event()
        self._status_mid: int | None = None
        self._status_acked = threading.Event()

        self._socket_open = False
        self._attempt = 0
        self._stop_requested = threading.Event()
        self._stop_deadline = 0.0
        self._stopped = threading.Event()
        self._last_loop = time.monotonic()
        self._net_thread: threading.Thread | None = None
        self._core = self._make_core()

    # -- construction ------------------------------------------------------------------------------

    def _make_core(self) -> MqttCore:
        s = self.settings
        core = MqttCore(
            s,
            self.client_id,
            on_event=self._events.put,
            on_message=self._on_message,
            quiet_ack=self._quiet_ack,
            on_quiet_ack=lambda: self._count("published"),
            single_writer=True,
        )
        # paho's own queue holds non-durable QoS 1 while offline; our durable window comes on top.
        core.set_limits(max_inflight=s.max_inflight, max_queued=s.max_queued + s.max_inflight)
        core.connect_async(persistent_session_s=s.session_expiry_s)
        return core

    # -- the core's reports (paho's callbacks): enqueue or count only ------------------------------

    def _quiet_ack(self, mid: int) -> bool:
        # Runs on the network thread, the only one that touches _durable_inflight and _status_mid.
        # A success nobody waits for (a QoS 1 sample, say) is only counted: no event round trip.
        return mid not in self._durable_inflight and mid != self._status_mid

    def _on_message(self, message: InboundMessage) -> None:
        if not self._inbox.offer(message):
            self._events.put(_InboxFull(message.topic))

    # -- public API --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the network and dispatcher threads; connects in the background, never raises."""
        if self._net_thread is not None:
            raise RuntimeError("MqttLink.start() called twice")
        self._net_thread = threading.Thread(target=self._run_network, name="mqtt-network", daemon=True)
        self._dispatcher.start()
        self._net_thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Flush (bounded by ``timeout``), publish the retained offline status, disconnect, join threads.

        Flush: wait for the spool to drain, then publish offline (QoS 1) and wait for its PUBACK.
        The broker acknowledges QoS 1 in order, so that PUBACK also confirms every earlier message.
        """
        if self._net_thread is None:
            return
        self._stop_deadline = time.monotonic() + timeout
        self._stop_requested.set()
        self._core.wake_now()
        self._net_thread.join(timeout + 2.0)
        self._dispatcher.stop(2.0)
        self._stopped.set()

    @property
    def connected(self) -> bool:
        """True between a successful CONNACK and the loss of that connection."""
        return self._connected

    @property
    def session(self) -> int:
        """Session number of the current (or last) connection attempt."""
        return self._session

    def healthy(self) -> bool:
        """True while both threads are alive and the network loop turned recently (systemd watchdog)."""
        if self._net_thread is None or not self._net_thread.is_alive() or not self._dispatcher.alive():
            return False
        return time.monotonic() - self._last_loop < max(10.0, 2.0 * self.settings.keepalive_s)

    def counter(self, name: str) -> int:
        """One counter of :meth:`stats` (``inbox_dropped``, ...), without the spool and inbox readings."""
        with self._counts_lock:
            return self._counts[name]

    def stats(self) -> dict[str, float]:
        """Counters since start, plus ``spool_depth``, ``inbox_depth`` and ``connected`` (0/1)."""
        with self._counts_lock:
            out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
        out["spool_depth"] = float(self._spool.count())
        out["inbox_depth"] = float(len(self._inbox))
        out["connected"] = 1.0 if self._connected else 0.0
        out["session"] = float(self._session)
        return out

    def payload_limit(self, topic: str, properties: PublishProperties | None = None) -> int:
        """Largest payload publishable on ``topic`` now: our setting and the broker's packet limit."""
        limit = self.settings.max_payload_bytes
        if self._broker_max_packet is not None:
            limit = min(limit, payload_limit(self._broker_max_packet, topic, properties))
        return limit

    def publish(
        self,
        topic: str,
        payload: bytes | BaseModel,
        *,
        qos: int = 0,
        retain: bool = False,
        durable: bool = False,
        kind: MessageKind = "state",
        properties: PublishProperties | None = None,
    ) -> None:
        """Publish a message.

        ``durable``: stored in the spool first (QoS 1), removed only on a successful PUBACK, replayed
        after reconnects and restarts. ``kind`` picks its spool policy: a ``result`` may be dropped at
        the spool's cap or on a full disk while disconnected (counted) and expires; a ``state`` (job
        status) never is: when the spool cannot store it (full disk), it waits in paho's memory queue
        like a non-durable QoS 1 message instead (counted as ``spool_fallback_memory``), as a result
        does while connected. Otherwise QoS 0 while disconnected is dropped (counted) and QoS 1
        waits in paho's memory queue, bounded by ``max_queued`` (overflow counted, no error).
        Raises TransportError for a payload over the size limit (nothing is sent) and ValueError for
        QoS 2 (never used: paho reports broker rejections of QoS 2 as success).
        """
        data = encode(payload) if isinstance(payload, BaseModel) else bytes(payload)
        if qos not in (0, 1):
            raise ValueError(f"QoS {qos} is not supported by the link (use 0 or 1)")
        limit = self.payload_limit(topic, properties)
        if len(data) > limit:
            self._count("refused_oversize")
            raise TransportError(
                f"payload of {len(data)} bytes for {topic} exceeds the limit of {limit} bytes "
                f"(mqtt.max_payload_bytes={self.settings.max_payload_bytes}, broker maximum packet size="
                f"{self._broker_max_packet}); not sent: send less (truncate tensors) or raise both limits"
            )
        if durable:
            if properties is not None:
                raise ValueError(
                    "durable messages cannot carry MQTT 5 properties (the spool does not store them)"
                )
            try:
                self._spool.add_many(
                    [SpoolEntry(topic, data, retain, kind)], raise_on_failure=self._connected
                )
            except SpoolWriteError as exc:
                if not self._connected:
                    # Full disk, broker away: only a job state gets here (results are dropped and
                    # counted by the spool). The caller holds it and offers it again, to the spool
                    # once space returns (durable again) or to the link once connected.
                    raise TransportError(
                        f"the spool cannot store {topic} ({exc}) and the broker is not connected; "
                        "hold it and publish it again"
                    ) from exc
                # Full disk, broker there: out from paho's memory queue (QoS 1) rather than lost; the
                # spool warned once, no traceback per message.
                self._count("spool_fallback_memory")
                self._publish_now(topic, data, 1, retain, None)
                return
            self._spooled()
            return
        self._publish_now(topic, data, qos, retain, properties)

    def publish_durable(
        self, messages: Sequence[tuple[str, bytes | BaseModel]], *, kind: MessageKind
    ) -> list[str | None]:
        """Spool many durable QoS 1 messages in one transaction (one fsync for all), then send them.

        What :meth:`publish` does with ``durable=True`` for each, at a fraction of the disk cost.
        Returns, per message, None or why it was refused (a payload over the size limit: counted,
        never sent; the others go on). When the spool cannot write (full disk) while the link is
        connected, they are sent from memory (QoS 1, counted as ``spool_fallback_memory``).
        """
        entries = []
        refused: list[str | None] = []
        for topic, payload in messages:
            data = encode(payload) if isinstance(payload, BaseModel) else bytes(payload)
            limit = self.payload_limit(topic)
            if len(data) > limit:
                self._count("refused_oversize")
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
            self._spool.add_many(entries, raise_on_failure=self._connected)
        except SpoolWriteError:
            self._count("spool_fallback_memory", len(entries))
            for entry in entries:
                self._publish_now(entry.topic, entry.payload, 1, entry.retain, None)
            return refused
        self._spooled()
        return refused

    def _spooled(self) -> None:
        """Messages wait in the spool: the network thread sends them now, not at its next idle turn."""
        self._spool_wake.set()
        self._core.wake()

    def _wait_for_backlog(self) -> None:
        """Connected with a backlog of more than a few windows: wait (bounded) for the link to catch up.

        Not while disconnected: then the spool is the outage buffer, bounded by its caps.
        """
        deadline = time.monotonic() + _BACKLOG_WAIT_S
        while self._connected and self._spool.count() > self._backlog_limit:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop_requested.is_set():
                return
            self._spool_room.clear()
            self._spool_room.wait(min(remaining, 0.05))

    def _publish_now(
        self, topic: str, data: bytes, qos: int, retain: bool, properties: PublishProperties | None
    ) -> None:
        if qos == 0 and not self._connected:
            self._count("dropped_offline")
            return
        sent = self._core.publish(topic, data, qos=qos, retain=retain, properties=properties)
        if sent.outcome is PublishOutcome.QUEUED and qos == 0:
            # Counted when handed to paho while connected: the core's client reports no QoS 0
            # write (that report cost half of paho's CPU per result; see agent/mqtt/core.py).
            self._count("published")
        elif sent.outcome is PublishOutcome.QUEUE_FULL:
            self._count("dropped_queue_full")
        elif sent.outcome is PublishOutcome.NO_CONNECTION and qos == 0:
            self._count("dropped_offline")
        elif sent.outcome is PublishOutcome.ERROR:
            # NO_CONNECTION for QoS 1 means "queued in memory, sent after reconnect".
            self._count("dropped_offline")
            log.warning("mqtt.publish.failed", topic=topic, rc=sent.error)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Call ``handler`` (on the dispatcher thread) for every message matching ``topic_filter``.

        Remembered and subscribed again on every reconnect. Handler exceptions are logged and counted.
        """
        if qos not in (0, 1):
            raise ValueError(f"QoS {qos} is not supported by the link (use 0 or 1)")
        self._dispatcher.add(topic_filter, handler, qos)
        # If the network thread connects concurrently it subscribes too: a double SUBSCRIBE is harmless.
        if self._connected:
            self._core.subscribe(topic_filter, qos)

    def wait_connected(self, timeout: float) -> bool:
        """Wait until connected; False after ``timeout`` seconds (tools and benchmarks, not the agent)."""
        return self._connected_event.wait(timeout)

    # -- internals ---------------------------------------------------------------------------------

    def _set_connected(self, connected: bool) -> None:
        self._connected = connected
        if connected:
            self._connected_event.set()
        else:
            self._connected_event.clear()

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    def _status(self, state: Literal["online", "offline"]) -> bytes:
        return encode(StatusMessage(state=state, session=self._session, agent_version=self.agent_version))

    def _next_session(self) -> int:
        # Best-effort write (see agent/mqtt/session.py): connecting must work on a full disk.
        return self._sessions.next()

    def _run_network(self) -> None:
        while True:
            self._last_loop = time.monotonic()
            try:
                if self._network_step():
                    return
            except Exception as exc:
                self._count("callback_errors")
                log.exception("mqtt.network.failed", error=repr(exc))
                self._stop_requested.wait(0.5)

    def _network_step(self) -> bool:
        """One turn of the network thread; True when it should exit."""
        if self._stop_requested.is_set() and self._shutdown_step():
            return True
        if not self._socket_open:
            if self._stop_requested.is_set():
                return True
            self._session = self._next_session()
            self._core.will_set(self.status_topic, self._status("offline"), qos=1, retain=True)
            try:
                self._core.reconnect()
                self._socket_open = True
            except Exception as exc:  # noqa: BLE001 - OSError, ssl errors, DNS: all mean "retry later"
                self._count("connect_failures")
                log.warning(
                    "mqtt.connect.failed", host=self.settings.host, port=self.settings.port, error=str(exc)
                )
                self._sleep_backoff()
                return False
        self._core.rearm_wake()
        try:
            lost = self._core.loop(_STOP_LOOP_S if self._stop_requested.is_set() else _IDLE_LOOP_S)
        except Exception as exc:
            self._count("callback_errors")
            log.exception("mqtt.loop.failed", error=repr(exc))
            lost = repr(exc)
        self._handle_events()
        if self._connected:
            self._send_spooled()
        if lost is not None:
            self._handle_events()
            if self._connected:
                self._set_connected(False)
                log.warning("mqtt.connection.lost", rc=lost)
            self._socket_open = False
            if self._stop_requested.is_set():
                return True
            self._sleep_backoff()
        return False

    def _sleep_backoff(self) -> None:
        attempt = self._attempt
        self._attempt += 1
        delay = reconnect_delay(
            attempt, self.settings.reconnect_min_s, self.settings.reconnect_max_s, self._rng
        )
        log.info("mqtt.reconnect.wait", delay_s=round(delay, 3), attempt=attempt)
        end = time.monotonic() + delay
        while not self._stop_requested.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            self._last_loop = time.monotonic()
            self._stop_requested.wait(min(remaining, 1.0))

    def _handle_events(self) -> None:
        """Apply what paho's callbacks reported."""
        try:
            self._apply_events()
        finally:
            if self._acked:
                acked, self._acked = self._acked, []
                self._spool.remove_many(acked)
                self._spool_room.set()

    def _apply_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, ConnAck):
                if event.ok:
                    self._on_connack(event.max_packet, event.receive_max)
                else:
                    log.error("mqtt.connect.refused", reason=event.reason, client_id=self.client_id)
            elif isinstance(event, PubAck):
                self._on_puback(event.mid, event.code, event.reason)
            elif isinstance(event, Disconnected):
                if self._connected and not self._stop_requested.is_set():
                    log.warning("mqtt.disconnected", reason=event.reason)
                self._set_connected(False)
            elif isinstance(event, SubAck):
                if event.failed:
                    log.error("mqtt.subscribe.refused", mid=event.mid, reasons=list(event.failed))
            elif isinstance(event, _InboxFull):
                self._count("inbox_dropped")
                log.warning("mqtt.inbox.full", topic=event.topic, size=self._inbox.maxsize)
            elif isinstance(event, CallbackFailed):
                self._count("callback_errors")
                log.error("mqtt.callback.failed", callback=event.callback, error=event.error)

    def _on_connack(self, max_packet: int | None, receive_max: int | None) -> None:
        if self._ever_connected:
            self._count("reconnects")
        self._ever_connected = True
        self._end_denied_run()
        self._set_connected(True)
        self._attempt = 0
        self._broker_max_packet = max_packet
        # paho ignores the broker's Receive Maximum (and cannot change its own limit while connected):
        # keep at least our durable window within it.
        self._window = min(self.settings.max_inflight, receive_max or self.settings.max_inflight)
        log.info("mqtt.connected", session=self._session, max_packet=max_packet, receive_max=receive_max)
        for sub in self._dispatcher.subscriptions():
            self._core.subscribe(sub.topic_filter, sub.qos)
        self._core.publish(self.status_topic, self._status("online"), qos=1, retain=True)
        self._spool_wake.set()
        self._inbox.put_control(Connected(self._session))

    def _on_puback(self, mid: int, code: int, reason: str) -> None:
        spool_id = self._durable_inflight.pop(mid, None)
        if mid == self._status_mid:
            self._status_acked.set()
        if code < 0x80:
            self._count("published")
            self._end_denied_run()
        elif code == NOT_AUTHORIZED:
            # Retrying cannot succeed: count it and (if durable) drop it from the spool. Logged once
            # per episode: a misconfigured device is refused at frame rate (durable results).
            self._count("acl_denied")
            self._denied_run += 1
            if self._denied_run == 1:
                log.error(
                    "mqtt.publish.denied",
                    mid=mid,
                    reason=reason,
                    spool_id=spool_id,
                    client_id=self.client_id,
                    hint="the broker's ACL refuses this topic for this user name; if every topic is "
                    "refused, the device id is not the certificate CN. Logged once until a publish "
                    "is accepted again; counted in mqtt.acl_denied",
                )
        else:
            self._count("broker_refused")
            log.error("mqtt.publish.refused", mid=mid, reason=reason, spool_id=spool_id)
        if spool_id is not None:
            self._acked.append(spool_id)
            self._spool_wake.set()

    def _end_denied_run(self) -> None:
        if self._denied_run:
            log.warning("mqtt.publish.denied.ended", refused=self._denied_run, client_id=self.client_id)
            self._denied_run = 0

    def _send_spooled(self) -> None:
        if not self._spool_wake.is_set():
            return
        free = self._window - len(self._durable_inflight)
        if free <= 0:
            return  # a PUBACK sets the wake flag again
        self._spool_wake.clear()
        batch = self._spool.pending(limit=free, after_id=self._spool_cursor)
        for msg in batch:
            limit = self.payload_limit(msg.topic)
            if len(msg.payload) > limit:
                # Spooled before the broker's (smaller) limit was known: it can never be delivered.
                self._count("refused_oversize")
                log.error("mqtt.spool.oversize_dropped", topic=msg.topic, size=len(msg.payload), limit=limit)
                self._spool.remove(msg.id)
                self._spool_cursor = msg.id
                continue
            sent = self._core.publish(
                msg.topic, msg.payload, qos=1, retain=msg.retain, properties=_expiry(msg.expires_at)
            )
            if sent.outcome is PublishOutcome.QUEUE_FULL:
                self._spool_wake.set()  # paho's queue is full of non-durable messages: try again later
                break
            # SUCCESS, or NO_CONN (connection just dropped): paho holds it and resends after reconnect.
            self._durable_inflight[sent.mid] = msg.id
            self._spool_cursor = msg.id
        self._spool.mark_sent(self._spool_cursor)
        if len(batch) == free:
            self._spool_wake.set()  # there may be more

    def _shutdown_step(self) -> bool:
        """One step of the graceful stop; True when the network thread may exit."""
        now = time.monotonic()
        if not self._connected or not self._socket_open:
            return True
        drained = self._spool.count() == 0 and not self._durable_inflight
        # Keep a quarter of the time for the offline status.
        drain_deadline = self._stop_deadline - 0.25 * max(self._stop_deadline - now, 0.0)
        if self._status_mid is None and (drained or now >= drain_deadline):
            sent = self._core.publish(self.status_topic, self._status("offline"), qos=1, retain=True)
            self._status_mid = sent.mid
            return False
        if self._status_mid is not None and (self._status_acked.is_set() or now >= self._stop_deadline):
            if not self._status_acked.is_set():
                log.warning("mqtt.stop.unflushed", spool_depth=self._spool.count())
            # A normal DISCONNECT: the broker discards the Last Will (we published offline ourselves).
            self._core.disconnect(flush_s=1.0, loop_timeout=_STOP_LOOP_S)
            self._handle_events()
            self._set_connected(False)
            log.info("mqtt.stopped", session=self._session, spool_depth=self._spool.count())
            return True
        return False


def _expiry(expires_at: float | None) -> PublishProperties | None:
    """MQTT 5 Message Expiry Interval for a spooled message with a time-to-live (the broker then drops
    it for a subscriber that was offline longer than it is worth)."""
    if expires_at is None:
        return None
    return PublishProperties(message_expiry_s=max(1, math.ceil(expires_at - time.time())))
