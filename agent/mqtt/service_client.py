"""An MQTT 5 client for operator-side services (chunk server, deploy, benchmarks).

:class:`agent.mqtt.link.MqttLink` is a *device*: spool, status topic, Last Will, one subscription
dispatch by topic match. A service needs other things: shared subscriptions (``$share/group/...``,
which a topic match cannot dispatch), request/response properties on what it receives and sends,
and a count of PUBACKs so it can wait until what it published has left. This is that client.

Built on :class:`~agent.mqtt.core.MqttCore` (the paho core, which owns every paho trap it can):
received messages go through a bounded :class:`~agent.mqtt.inbound.Inbox` to one dispatcher thread, so
a slow handler never stalls paho's network thread; the core's events update this client's counters
under ``_cond``, which is never held while calling into the core (so ``on_publish``, run under paho's
lock, cannot deadlock: paho#226); paho's reconnect delay has no jitter, so the first delay is drawn
at random per client.
"""

from __future__ import annotations

import collections
import random
import ssl
import threading
import uuid
from collections.abc import Callable

import structlog

from agent.errors import TransportError
from agent.mqtt.core import LastWill, MqttCore, PublishProperties, payload_limit
from agent.mqtt.events import CallbackFailed, ConnAck, Disconnected, Event, PubAck, PublishOutcome, SubAck
from agent.mqtt.inbound import STOP, InboundMessage, Inbox
from agent.mqtt.settings import MqttSettings

#: PUBACK reason codes kept for :meth:`ServiceClient.ack_code` (the latest ones).
_ACK_CODES_KEPT = 256

log = structlog.get_logger(__name__)

#: Called for every received message; its return value is ignored.
Handler = Callable[[InboundMessage], object]
#: Whether a received message may be dropped first when the dispatcher falls behind.
Sheddable = Callable[[InboundMessage], bool]


class ServiceClient:
    """Publish with MQTT 5 properties, subscribe (shared subscriptions too), count acks.

    ``handler`` is called on the ``mqtt-service-dispatch`` thread for every message received on any
    subscription, one at a time. Reconnects are automatic; subscriptions are renewed on each connect.
    """

    def __init__(
        self,
        settings: MqttSettings,
        *,
        client_id: str | None = None,
        handler: Handler | None = None,
        inbox_size: int = 1024,
        max_inflight: int = 20,
        last_will: LastWill | None = None,
        reconnect: bool = True,
        sheddable: Sheddable | None = None,
    ) -> None:
        """``last_will``: published by the broker if this client's connection ends unannounced.

        ``reconnect`` False: once lost, the connection stays lost (:attr:`connects` tells).

        ``sheddable``: messages that may go first when the dispatcher falls behind. Once half of
        ``inbox_size`` messages wait, those are dropped (counted in :attr:`inbox_shed`), so the other
        half stays for the rest, which are dropped only when the inbox is full (:attr:`inbox_dropped`).
        """
        self.settings = settings
        self.client_id = client_id or f"service-{uuid.uuid4().hex[:10]}"
        self._handler = handler
        self._inbox = Inbox(inbox_size)
        self._sheddable = sheddable
        self._shed_at = max(1, inbox_size // 2)
        self._filters: list[tuple[str, int]] = []
        self._cond = threading.Condition()  # guards the fields below; never held while calling paho
        self._connected = False
        self._refused: str | None = None  # the broker's reason when it refused our CONNECT
        self._taken_over = False  # a connection was closed with "Session taken over"
        self._connects = 0
        self._max_packet: int | None = None
        self._subacks: dict[int, list[str]] = {}
        self._sent = 0
        self._acked = 0
        self._failed_acks = 0
        # The latest PUBACK reason codes by message id, a bounded few: a caller may ask how one
        # publish was answered (NO_MATCHING_SUBSCRIBERS: nobody listens on that topic).
        self._ack_codes: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.inbox_dropped = 0
        self.inbox_shed = 0
        self.callback_errors = 0
        self.handler_errors = 0
        self._dispatch: threading.Thread | None = None
        self._core = MqttCore(
            settings,
            self.client_id,
            on_event=self._on_event,
            on_message=self._on_message,
            reconnect=reconnect,
        )
        if last_will is not None:
            self._core.will_set(
                last_will.topic, last_will.payload, qos=last_will.qos, retain=last_will.retain
            )
        self._core.set_limits(max_inflight=max_inflight)
        first = random.uniform(settings.reconnect_min_s, 2 * settings.reconnect_min_s)
        self._core.set_reconnect_delay(first, max(first, settings.reconnect_max_s))

    # -- the core's reports: record and return (they run on paho's thread) ---------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, ConnAck):
            self._on_connack(event)
        elif isinstance(event, Disconnected):
            with self._cond:
                self._connected = False
                self._taken_over = self._taken_over or event.taken_over
                self._cond.notify_all()
        elif isinstance(event, PubAck):
            with self._cond:
                self._acked += 1
                if not event.ok:
                    self._failed_acks += 1
                self._ack_codes[event.mid] = event.code
                while len(self._ack_codes) > _ACK_CODES_KEPT:
                    self._ack_codes.popitem(last=False)
                self._cond.notify_all()
        elif isinstance(event, SubAck):
            if event.failed:
                log.error(
                    "mqtt.service.subscribe_refused", client_id=self.client_id, reasons=list(event.failed)
                )
            with self._cond:
                self._subacks[event.mid] = list(event.failed)
                self._cond.notify_all()
        elif isinstance(event, CallbackFailed):
            self.callback_errors += 1
            log.error("mqtt.service.callback_failed", callback=event.callback, error=event.error)

    def _on_connack(self, event: ConnAck) -> None:
        if not event.ok:
            log.error("mqtt.service.refused", client_id=self.client_id, reason=event.reason)
            with self._cond:
                self._refused = event.reason
                self._cond.notify_all()
            return
        with self._cond:
            self._connected = True
            self._connects += 1
            self._max_packet = event.max_packet
            filters = list(self._filters)
            self._cond.notify_all()
        for topic_filter, qos in filters:
            self._core.subscribe(topic_filter, qos)

    def _on_message(self, message: InboundMessage) -> None:
        sheddable = self._sheddable
        if sheddable is not None and len(self._inbox) >= self._shed_at and sheddable(message):
            self.inbox_shed += 1
        elif not self._inbox.offer(message):
            self.inbox_dropped += 1

    # -- public API ----------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> ServiceClient:
        """Connect and start the threads; raise TransportError if not connected within ``timeout``.

        Fails at once, with the reason, when the first connection attempt is refused (nothing listens
        there, the name does not resolve, TLS fails) or the broker refuses the CONNECT (credentials):
        waiting out ``timeout`` would not change the answer. The error names what to check as the
        user set it (``settings.address_from``: ``--broker`` or ``mqtt.host/port``).
        """
        if self._dispatch is not None:
            raise RuntimeError("ServiceClient.start() called twice")
        s = self.settings
        where = f"the MQTT broker at {s.host}:{s.port}"
        self._core.connect_async()
        try:
            # The first attempt on this thread, so its OSError reaches us; paho's loop thread would
            # only retry it quietly (loop_forever(retry_first_connection=True)). Reconnects after
            # a lost connection stay with the loop thread.
            self._core.reconnect()
        except ssl.SSLError as exc:
            tls = "--tls-ca, --tls-cert, --tls-key" if s.address_from.startswith("--") else "mqtt.tls"
            reason = getattr(exc, "verify_message", None) or exc.reason or exc
            raise TransportError(f"TLS with {where} failed ({reason}); check {tls}") from exc
        except OSError as exc:
            hint = " (is the broker running there?)" if isinstance(exc, ConnectionRefusedError) else ""
            raise TransportError(
                f"cannot connect to {where}: {_os_reason(exc)}; check {s.address_from}{hint}"
            ) from exc
        self._dispatch = threading.Thread(
            target=self._run_dispatch, name="mqtt-service-dispatch", daemon=True
        )
        self._dispatch.start()
        self._core.loop_start()
        with self._cond:
            self._cond.wait_for(lambda: self._connected or self._refused is not None, timeout)
            connected, refused = self._connected, self._refused
        if connected:
            return self
        self.stop()
        if refused is not None:
            flags = s.address_from.startswith("--")
            check = (
                "--username, --password-file, --tls-cert/--tls-key, --client-id-prefix"
                if flags
                else "mqtt.username, mqtt.password_file, mqtt.tls, mqtt.client_id_prefix"
            )
            raise TransportError(f"{where} refused the connection ({refused}); check {check}")
        raise TransportError(
            f"no answer from {where} within {timeout:.0f}s; check {s.address_from}, TLS files and credentials"
        )

    def stop(self) -> None:
        """Disconnect and join the threads (what is not yet acknowledged is dropped)."""
        self._core.disconnect()
        self._core.loop_stop()
        self._inbox.put_control(STOP)
        if self._dispatch is not None:
            self._dispatch.join(5.0)

    @property
    def connected(self) -> bool:
        """True between a successful CONNACK and the loss of that connection."""
        return self._connected

    @property
    def taken_over(self) -> bool:
        """True once the broker closed a connection of this client because another connection took
        its client id (DISCONNECT "Session taken over"; brokers that send it: mosquitto 2.0.15 and
        later, not 2.0.11, which closes the socket as for any other loss)."""
        return self._taken_over

    @property
    def connects(self) -> int:
        """Successful connections so far (1 after the first, +1 per reconnect)."""
        return self._connects

    def wait_connected(self, timeout: float) -> bool:
        """Wait until connected; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._connected, timeout)

    def subscribe(self, topic_filter: str, qos: int = 1, timeout: float = 10.0) -> None:
        """Subscribe now and on every reconnect; when connected, wait for the SUBACK.

        Raises TransportError when the broker refuses the subscription or does not answer in time.
        """
        with self._cond:
            self._filters.append((topic_filter, qos))
        if not self._connected:
            return
        mid = self._core.subscribe(topic_filter, qos)
        if mid is None:
            return  # disconnected meanwhile: on_connect subscribes again
        with self._cond:
            if not self._cond.wait_for(lambda: mid in self._subacks, timeout):
                raise TransportError(f"no SUBACK for {topic_filter} within {timeout:.0f}s")
            failed = self._subacks.pop(mid)
        if failed:
            raise TransportError(f"broker refused the subscription {topic_filter}: {', '.join(failed)}")

    def payload_limit(self, topic: str, properties: PublishProperties | None = None) -> int | None:
        """Largest payload the broker accepts on ``topic`` (None: the broker announced no limit)."""
        if self._max_packet is None:
            return None
        return payload_limit(self._max_packet, topic, properties)

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: PublishProperties | None = None,
    ) -> int:
        """Queue a publish (sent by paho's thread; QoS 1 waits in memory while disconnected); its
        message id, for :meth:`ack_code`.

        Raises TransportError when the payload exceeds the broker's maximum packet size.
        """
        limit = self.payload_limit(topic, properties)
        if limit is not None and len(payload) > limit:
            raise TransportError(
                f"payload of {len(payload)} bytes for {topic} exceeds the broker's limit of {limit} bytes; "
                "use smaller chunks or raise max_packet_size in mosquitto.conf"
            )
        if qos == 1:
            with self._cond:
                self._sent += 1
        sent = self._core.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if sent.outcome not in (PublishOutcome.QUEUED, PublishOutcome.NO_CONNECTION):
            if qos == 1:
                with self._cond:
                    self._sent -= 1
            raise TransportError(f"publish to {topic} failed: {sent.error or sent.outcome.value}")
        return sent.mid

    def ack_code(self, mid: int, timeout: float) -> int | None:
        """The PUBACK reason code of the QoS 1 publish ``mid`` (:meth:`publish`'s answer), or None when
        none arrived within ``timeout`` (or it is long forgotten: only the latest few are kept)."""
        with self._cond:
            self._cond.wait_for(lambda: mid in self._ack_codes, timeout)
            return self._ack_codes.get(mid)

    def wait_published(self, timeout: float, *, at_most: int = 0) -> bool:
        """Wait until at most ``at_most`` QoS 1 messages published so far are unacknowledged.

        ``at_most=0``: everything published has been acknowledged. False on timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._sent - self._acked <= at_most, timeout)

    def delivery_counts(self) -> tuple[int, int]:
        """QoS 1 messages published so far and how many of them the broker acknowledged."""
        with self._cond:
            return self._sent, self._acked

    def stats(self) -> dict[str, int]:
        """Counters: published/acked/failed acks, connects, drops and errors."""
        with self._cond:
            return {
                "published": self._sent,
                "acked": self._acked,
                "failed_acks": self._failed_acks,
                "connects": self._connects,
                "inbox_dropped": self.inbox_dropped,
                "inbox_shed": self.inbox_shed,
                "callback_errors": self.callback_errors,
                "handler_errors": self.handler_errors,
            }

    # -- dispatch ------------------------------------------------------------------------------------

    def _run_dispatch(self) -> None:
        while True:
            item = self._inbox.take(timeout=1.0)
            if item is None:
                continue
            if item is STOP:
                return
            if isinstance(item, InboundMessage) and self._handler is not None:
                try:
                    self._handler(item)
                except Exception as exc:
                    self.handler_errors += 1
                    log.exception("mqtt.service.handler_failed", topic=item.topic, error=repr(exc))


def _os_reason(exc: OSError) -> str:
    """``Connection refused``, ``Name or service not known``, a TLS failure: short, without errno noise."""
    return str(exc.strerror or exc)
