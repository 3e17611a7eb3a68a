"""The MQTT link of a device: one :class:`~agent.mqtt.core.MqttCore`, driven by our own network thread.

Why it is built this way (each point is a paho 2.x or mosquitto trap, see docs/protocol.md; the
paho side of each lives in :mod:`agent.mqtt.core`, the only module that imports paho):

* Our thread runs the core's loop and does every socket read and write: other threads only queue
  a packet (the core is a ``single_writer``) and wake the loop, once per turn (``CoalescedWake``:
  paho writes a wake byte per publish). paho reports no QoS 0 write to the core (two objects per
  result): a QoS 0 message counts as ``published`` when queued while connected.
* We reconnect with jittered exponential backoff (paho's has no jitter: a fleet in lockstep).
* The core's events only go into ``_events`` (messages into the inbox), handled by the network
  thread after each turn: our lock in ``on_publish`` could deadlock against paho's (paho#226).
* Durable messages are published only by the network thread, so that a PUBACK always finds its
  spool id (:mod:`agent.mqtt.durable`).
* paho ignores the broker's Maximum Packet Size and resends an oversized QoS 1 message forever
  (paho#760): sizes are checked here, against our limit and the CONNACK's.

One job (the connection's life: connect, reconnect, the core's events, subscriptions, the online
and offline status): one state machine that only the network thread touches. Durable messages
(spool, window, acknowledgements) are :class:`~agent.mqtt.durable.DurableMessages`, which says
which of its methods that thread calls; the dispatcher and the counters are their own modules.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

import structlog
from pydantic import BaseModel

from agent.backoff import reconnect_delay
from agent.errors import ConfigError, TransportError
from agent.mqtt.core import MqttCore, PublishProperties, payload_limit
from agent.mqtt.dispatch import Dispatcher, Handler
from agent.mqtt.durable import DurableMessages
from agent.mqtt.events import CallbackFailed, ConnAck, Disconnected, Event, PubAck, PublishOutcome, SubAck
from agent.mqtt.inbound import Connected, InboundMessage, Inbox, InboxFull
from agent.mqtt.link_counters import LinkCounters
from agent.mqtt.session import SESSION_KEY, SessionCounter
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import StatusMessage, encode
from agent.spool.queue import MessageKind, Spool

log = structlog.get_logger(__name__)

__all__ = ["SESSION_KEY", "MqttLink", "PublishProperties"]
#: Longest one turn of the network loop waits on the socket. What another thread asks of the loop
#: (a publish, a spooled message to send, stop) wakes it at once through paho's socket pair, so this
#: only paces housekeeping (keepalive): an idle link should cost next to nothing, on a Jetson as in
#: a simulated fleet of thousands (bench/fleetsim_idle.py).
_IDLE_LOOP_S = 0.5
#: While stopping, the stop's deadlines are checked this often.
_STOP_LOOP_S = 0.05


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
        idle_loop_s: float | None = None,
    ) -> None:
        """``idle_loop_s``: the longest idle turn (default :data:`_IDLE_LOOP_S`; the fleet simulator,
        with a thousand links on two cores, turns less often: agent/fleetsim/device.py)."""
        self.settings = settings
        self._idle_loop_s = _IDLE_LOOP_S if idle_loop_s is None else idle_loop_s
        self.client_id = client_id
        self.status_topic = status_topic
        self.agent_version = agent_version
        self._spool = spool
        self._rng = random.Random()

        self._events: queue.SimpleQueue[Event | InboxFull] = queue.SimpleQueue()
        self._inbox = Inbox(settings.inbox_size)
        self._counters = LinkCounters(client_id)
        self._dispatcher = Dispatcher(
            self._inbox, on_connected=on_connected, on_error=lambda: self._counters.count("handler_errors")
        )

        self._connected = False
        self._connected_event = threading.Event()  # mirrors _connected, for wait_connected()
        self._ever_connected = False
        self._session = 0
        self._sessions = SessionCounter(spool)
        self._broker_max_packet: int | None = None
        self._status_mid: int | None = None
        self._status_acked = threading.Event()

        self._socket_open = False
        self._attempt = 0
        self._move_requested = threading.Event()
        self._stop_requested = threading.Event()
        self._stop_deadline = 0.0
        self._stopped = threading.Event()
        self._last_loop = time.monotonic()
        self._net_thread: threading.Thread | None = None
        self._core = self._make_core()
        self._durable = DurableMessages(
            spool,
            settings.max_inflight,
            self._counters,
            connected=lambda: self._connected,
            stopping=self._stop_requested,
            payload_limit=self.payload_limit,
            send_from_memory=lambda topic, data, retain: self._publish_now(topic, data, 1, retain, None),
            wake=self._core.wake,
        )

    def _make_core(self) -> MqttCore:
        s = self.settings
        core = MqttCore(
            s,
            self.client_id,
            on_event=self._events.put,
            on_message=self._on_message,
            quiet_ack=self._quiet_ack,
            on_quiet_ack=lambda: self._counters.count("published"),
            single_writer=True,
        )
        # paho's own queue holds non-durable QoS 1 while offline; our durable window comes on top.
        core.set_limits(max_inflight=s.max_inflight, max_queued=s.max_queued + s.max_inflight)
        core.connect_async(persistent_session_s=s.session_expiry_s)
        return core

    # -- the core's reports (paho's callbacks): enqueue or count only ------------------------------

    def _quiet_ack(self, mid: int) -> bool:
        # Runs on the network thread, the only one that touches the durable window and _status_mid.
        # A success nobody waits for (a QoS 1 sample, say) is only counted: no event round trip.
        return not self._durable.in_flight(mid) and mid != self._status_mid

    def _on_message(self, message: InboundMessage) -> None:
        if not self._inbox.offer(message):
            self._events.put(InboxFull(message.topic))

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
        return self._counters.get(name)

    def stats(self) -> dict[str, float]:
        """Counters since start, plus ``spool_depth``, ``inbox_depth`` and ``connected`` (0/1)."""
        out = self._counters.snapshot()
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
        after reconnects and restarts, by the spool policy ``kind`` picks
        (:meth:`~agent.mqtt.durable.DurableMessages.publish`). Otherwise QoS 0 while disconnected is
        dropped (counted) and QoS 1 waits in paho's memory queue, bounded by ``max_queued``
        (overflow counted, no error). Raises TransportError for a payload over the size limit
        (nothing is sent) and ValueError for QoS 2 (never used: paho reports broker rejections of
        QoS 2 as success).
        """
        data = encode(payload) if isinstance(payload, BaseModel) else bytes(payload)
        if qos not in (0, 1):
            raise ValueError(f"QoS {qos} is not supported by the link (use 0 or 1)")
        limit = self.payload_limit(topic, properties)
        if len(data) > limit:
            self._counters.count("refused_oversize")
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
            self._durable.publish(topic, data, retain, kind)
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
        return self._durable.publish_many(messages, kind=kind)

    def _publish_now(
        self, topic: str, data: bytes, qos: int, retain: bool, properties: PublishProperties | None
    ) -> None:
        if qos == 0 and not self._connected:
            self._counters.count("dropped_offline")
            return
        sent = self._core.publish(topic, data, qos=qos, retain=retain, properties=properties)
        if sent.outcome is PublishOutcome.QUEUED and qos == 0:
            # Counted when handed to paho while connected: the core's client reports no QoS 0
            # write (that report cost half of paho's CPU per result; see agent/mqtt/core.py).
            self._counters.count("published")
        elif sent.outcome is PublishOutcome.QUEUE_FULL:
            self._counters.count("dropped_queue_full")
        elif sent.outcome is PublishOutcome.NO_CONNECTION and qos == 0:
            self._counters.count("dropped_offline")
        elif sent.outcome is PublishOutcome.ERROR:
            # NO_CONNECTION for QoS 1 means "queued in memory, sent after reconnect".
            self._counters.count("dropped_offline")
            log.warning("mqtt.publish.failed", topic=topic, rc=sent.error)

    def hand_in(self, message: InboundMessage) -> bool:
        """Dispatch ``message`` as if the broker had sent it: to the same subscriptions' handlers, in
        order with received messages, on the dispatcher thread (an offline import's desired states).
        False when the inbox is full (nothing taken)."""
        return self._inbox.offer(message)

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

    def move_to_new_certificate(self) -> None:
        """Connect again at once with the client certificate now in ``mqtt.tls``'s files (renewed).

        The network thread reloads the files, ends the connection with a normal DISCONNECT (no Last
        Will, no offline status) and reconnects without a backoff wait: durable and QoS 1 messages
        wait in the spool and paho's queue meanwhile, QoS 0 ones are dropped (``dropped_offline``).
        If the new files do not load, the connection stays as it is (``certificate_move_failures``).
        """
        self._move_requested.set()
        self._core.wake_now()

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

    def _status(self, state: Literal["online", "offline"]) -> bytes:
        return encode(StatusMessage(state=state, session=self._session, agent_version=self.agent_version))

    def _run_network(self) -> None:
        while True:
            self._last_loop = time.monotonic()
            try:
                if self._network_step():
                    return
            except Exception as exc:
                self._counters.count("callback_errors")
                log.exception("mqtt.network.failed", error=repr(exc))
                self._stop_requested.wait(0.5)

    def _network_step(self) -> bool:
        """One turn of the network thread; True when it should exit."""
        if self._stop_requested.is_set() and self._shutdown_step():
            return True
        if self._move_requested.is_set() and not self._stop_requested.is_set():
            self._move_connection()
        if not self._socket_open:
            if self._stop_requested.is_set():
                return True
            # Best-effort write (see agent/mqtt/session.py): connecting must work on a full disk.
            self._session = self._sessions.next()
            self._core.will_set(self.status_topic, self._status("offline"), qos=1, retain=True)
            try:
                self._core.reconnect()
                self._socket_open = True
            except Exception as exc:  # noqa: BLE001 - OSError, ssl errors, DNS: all mean "retry later"
                self._counters.count("connect_failures")
                log.warning(
                    "mqtt.connect.failed", host=self.settings.host, port=self.settings.port, error=str(exc)
                )
                self._sleep_backoff()
                return False
        self._core.rearm_wake()
        try:
            lost = self._core.loop(_STOP_LOOP_S if self._stop_requested.is_set() else self._idle_loop_s)
        except Exception as exc:
            self._counters.count("callback_errors")
            log.exception("mqtt.loop.failed", error=repr(exc))
            lost = repr(exc)
        self._handle_events()
        if self._connected:
            self._durable.send(self._core)
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

    def _move_connection(self) -> None:
        """Reload the certificate, and end the connection so the next turn opens one with it."""
        self._move_requested.clear()
        try:
            self._core.reload_certificate()
        except ConfigError as exc:
            self._counters.count("certificate_move_failures")
            log.error("mqtt.certificate.reload_failed", error=str(exc))
            return
        self._counters.count("certificate_moves")
        log.info("mqtt.certificate.moved", session=self._session)
        if self._socket_open:
            self._core.disconnect(flush_s=1.0, loop_timeout=_STOP_LOOP_S)
            self._handle_events()
            self._set_connected(False)
            self._socket_open = False

    def _sleep_backoff(self) -> None:
        attempt, s = self._attempt, self.settings
        self._attempt += 1
        delay = reconnect_delay(attempt, s.reconnect_min_s, s.reconnect_max_s, self._rng)
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
            self._durable.remove_acknowledged()

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
            elif isinstance(event, InboxFull):
                self._counters.count("inbox_dropped")
                log.warning("mqtt.inbox.full", topic=event.topic, size=self._inbox.maxsize)
            elif isinstance(event, CallbackFailed):
                self._counters.count("callback_errors")
                log.error("mqtt.callback.failed", callback=event.callback, error=event.error)

    def _on_connack(self, max_packet: int | None, receive_max: int | None) -> None:
        if self._ever_connected:
            self._counters.count("reconnects")
        self._ever_connected = True
        self._counters.accepted()
        self._set_connected(True)
        self._attempt = 0
        self._broker_max_packet = max_packet
        log.info("mqtt.connected", session=self._session, max_packet=max_packet, receive_max=receive_max)
        for sub in self._dispatcher.subscriptions():
            self._core.subscribe(sub.topic_filter, sub.qos)
        self._core.publish(self.status_topic, self._status("online"), qos=1, retain=True)
        self._durable.connected(receive_max)
        self._inbox.put_control(Connected(self._session))

    def _on_puback(self, mid: int, code: int, reason: str) -> None:
        spool_id = self._durable.acknowledged(mid)
        if mid == self._status_mid:
            self._status_acked.set()
        self._counters.puback(mid, code, reason, spool_id)

    def _shutdown_step(self) -> bool:
        """One step of the graceful stop; True when the network thread may exit."""
        now = time.monotonic()
        if not self._connected or not self._socket_open:
            return True
        drained = self._durable.drained()
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
