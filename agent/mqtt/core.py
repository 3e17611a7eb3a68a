"""The paho core: the only module that imports paho. The device link and the operator's service client
are both built on :class:`MqttCore`.

What it owns, so that neither user has to know paho:

* making the client: MQTT 5, TLS, credentials, TCP_NODELAY (:func:`_new_paho_client`);
* paho's callbacks, which only turn paho's arguments into small typed events (:class:`ConnAck`,
  :class:`PubAck`, :class:`SubAck`, :class:`Disconnected`, :class:`CallbackFailed`) and hand them to
  the user's ``on_event``, and received messages (copied into :class:`InboundMessage`) to
  ``on_message``; inside a catch-all, because an exception escaping a callback kills paho's loop
  while ``is_connected()`` still says True. Both sinks must only enqueue or count: they run on paho's
  thread, some under paho's own lock (``on_publish``: paho#226), and must never call back into paho;
* publishing, with paho's return codes turned into a :class:`PublishOutcome`, and MQTT 5
  properties (:class:`PublishProperties`);
* the payload limit paho ignores (paho#760: an oversized QoS 1 message is resent for ever):
  :func:`payload_limit`;
* the wake-up socket pair of paho's loop (:class:`CoalescedWake`), for a user that runs the loop on
  its own thread;
* a PUBLISH decoder that copies the payload once (:func:`_decode_publish`): paho's copies a chunk
  reply about a dozen times.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt import _packet
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from agent.errors import ConfigError
from agent.mqtt.events import (
    CallbackFailed,
    ConnAck,
    Disconnected,
    Event,
    PubAck,
    PublishOutcome,
    Sent,
    SubAck,
)
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.settings import MqttSettings, TlsSettings
from agent.mqtt.wake import CoalescedWake
from agent.secret_file import read_secret

#: PUBACK reason code "Not authorized" (ACL denied).
NOT_AUTHORIZED = 0x87
#: Fixed header (<= 5) + packet id (2) + property length (<= 4) + slack for small properties.
PUBLISH_OVERHEAD = 16


@dataclass(frozen=True)
class LastWill:
    """What the broker publishes for a client whose connection ends without a DISCONNECT."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 1


@dataclass(frozen=True)
class PublishProperties:
    """MQTT 5 publish properties the agent uses (request/response and expiry)."""

    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    message_expiry_s: int | None = None

    def to_paho(self) -> Properties:
        """paho's Properties for a publish, packed once here (see :class:`_PackedProperties`)."""
        return _PackedProperties(self.pack())

    def pack(self) -> bytes:
        """The MQTT 5 property section: its length, then each property, in paho's order."""
        body = bytearray()
        if self.message_expiry_s is not None:
            body += b"\x02" + self.message_expiry_s.to_bytes(4, "big")
        if self.response_topic is not None:
            body += b"\x08" + _utf8(self.response_topic.encode())
        if self.correlation_data is not None:
            body += b"\x09" + _utf8(self.correlation_data)
        for key, value in self.user_properties:
            body += b"\x26" + _utf8(key.encode()) + _utf8(value.encode())
        return _variable_int(len(body)) + bytes(body)

    def wire_size(self) -> int:
        """Upper bound of the bytes these properties add to a PUBLISH packet."""
        size = 0
        if self.response_topic is not None:
            size += 3 + len(self.response_topic.encode())
        if self.correlation_data is not None:
            size += 3 + len(self.correlation_data)
        for key, value in self.user_properties:
            size += 5 + len(key.encode()) + len(value.encode())
        if self.message_expiry_s is not None:
            size += 5
        return size


def payload_limit(max_packet: int, topic: str, properties: PublishProperties | None = None) -> int:
    """Largest payload that fits a broker's Maximum Packet Size on ``topic`` with ``properties``."""
    extra = properties.wire_size() if properties is not None else 0
    return max_packet - PUBLISH_OVERHEAD - 2 - len(topic.encode()) - extra


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches ``topic_filter`` (``+`` and ``#`` wildcards), as paho matches.

    The dispatcher asks this for every received message and every subscription; paho's
    ``topic_matches_sub`` builds a matcher tree per call (tens of microseconds, GIL held). A filter
    with ``#`` anywhere but at its end is left to paho.
    """
    levels = _filter_levels(topic_filter)
    if levels is None:
        return bool(paho.topic_matches_sub(topic_filter, topic))
    parts = topic.split("/")
    if topic.startswith("$") and levels[0] in ("+", "#"):
        return False  # a wildcard never matches the first level of a $ topic
    for i, level in enumerate(levels):
        if level == "#":
            return True  # the rest, including no level at all ("a/#" matches "a")
        if i >= len(parts) or (level != "+" and level != parts[i]):
            return False
    return len(levels) == len(parts)


@functools.lru_cache(maxsize=256)
def _filter_levels(topic_filter: str) -> tuple[str, ...] | None:
    """The levels of a subscription filter, or None when ``#`` stands anywhere but last."""
    levels = tuple(topic_filter.split("/"))
    return None if "#" in levels[:-1] or any("#" in x and x != "#" for x in levels) else levels


_OUTCOMES = {
    MQTTErrorCode.MQTT_ERR_SUCCESS: PublishOutcome.QUEUED,
    MQTTErrorCode.MQTT_ERR_NO_CONN: PublishOutcome.NO_CONNECTION,
    MQTTErrorCode.MQTT_ERR_QUEUE_SIZE: PublishOutcome.QUEUE_FULL,
}


def disable_nagle(sock: Any) -> bool:
    """Set TCP_NODELAY; False when the socket does not take it (e.g. a TLS wrapper without it).

    paho leaves Nagle on: a small packet (PUBACK, chunk request) written while an earlier small
    one is unacknowledged waits for the peer's delayed ACK, ~40 ms on Linux, per round trip.
    """
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        return False
    return True


def _on_socket_open(_client: paho.Client, _userdata: object, sock: Any) -> None:
    disable_nagle(sock)


class _AckedOnlyClient(paho.Client):
    """paho's client reporting only acknowledged publishes (QoS 1 PUBACKs) to :attr:`on_ack`.

    paho calls ``on_publish`` also after writing each QoS 0 packet, and builds a PUBACK ReasonCode and
    Properties object to pass it: about half of paho's CPU per QoS 0 message, on the device link's
    network thread, for a call that only counts. With ``on_publish`` left unset paho builds nothing
    for QoS 0, and every acknowledgement still comes through ``_do_on_publish`` (paho 2.x; the
    acknowledgement tests of tests/mqtt/test_link.py fail if paho stops routing them there).
    """

    on_ack: Callable[[Any, Any, int, Any, Any], None] | None = None

    def _do_on_publish(self, mid: int, reason_code: Any, properties: Any) -> MQTTErrorCode:
        on_ack = self.on_ack
        if on_ack is not None:
            with self._in_callback_mutex:  # as paho calls on_publish
                on_ack(self, self._userdata, mid, reason_code, properties)
        rc: MQTTErrorCode = super()._do_on_publish(mid, reason_code, properties)
        return rc


def _new_paho_client(
    settings: MqttSettings,
    client_id: str,
    *,
    tls_context: ssl.SSLContext | None = None,
    reconnect: bool = True,
    acked_only: bool = False,
) -> paho.Client:
    """An MQTT 5 paho client with TLS (``tls_context``, from the settings) and the settings' credentials.

    ``reconnect`` False: paho's loop thread does not connect again once the connection is lost.
    ``acked_only``: an :class:`_AckedOnlyClient`.
    """
    client = (_AckedOnlyClient if acked_only else paho.Client)(
        CallbackAPIVersion.VERSION2,
        # The broker of docs/protocol.md refuses any id without its prefix, so a password account
        # can never name itself after a device (whose id, the certificate CN, has no such prefix).
        client_id=settings.client_id_prefix + client_id,
        protocol=paho.MQTTv5,
        reconnect_on_failure=reconnect,
    )
    if settings.tls is not None and tls_context is not None:
        client.tls_set_context(tls_context)
        client.tls_insecure_set(settings.tls.insecure)
    if settings.username is not None:
        password = read_secret(settings.password_file) if settings.password_file is not None else None
        client.username_pw_set(settings.username, password)
    client.on_socket_open = _on_socket_open
    return client


def _tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """What paho's ``tls_set`` makes (verify the broker, TLS client), kept so the certificate can be
    loaded again (:meth:`MqttCore.reload_certificate`); raises ConfigError naming the key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if tls.ca_file is not None:
            context.load_verify_locations(cafile=str(tls.ca_file))
        else:
            context.load_default_certs()
        _load_client_certificate(context, tls)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"mqtt.tls: cannot load the CA/certificate/key ({exc}); check the paths and that "
            "the key matches the certificate"
        ) from exc
    return context


def _load_client_certificate(context: ssl.SSLContext, tls: TlsSettings) -> None:
    if tls.cert_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)


def _utf8(data: bytes) -> bytes:
    """An MQTT length-prefixed string or binary field."""
    if len(data) > 0xFFFF:
        raise ValueError(f"an MQTT property field holds at most 65535 bytes, not {len(data)}")
    return len(data).to_bytes(2, "big") + data


def _variable_int(value: int) -> bytes:
    """MQTT's variable byte integer."""
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


#: An empty paho Properties for PUBLISH, whose tables every one the core makes shares (paho builds them anew
#: per object, and never changes them).
_EMPTY_PUBLISH_PROPERTIES = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class _PackedProperties(Properties):
    """paho Properties whose wire form is already packed.

    paho looks every property name up by scanning all of them, twice per property and once more per
    name when packing: about 80 microseconds a chunk reply, which carries four, on the chunk server's
    sending thread. Only ``pack()`` is read from a publish's properties (paho 2.x: ``_send_publish``,
    and again on a resend); tests/mqtt/test_core_decode.py checks the bytes against paho's own.
    """

    def __init__(self, packed: bytes) -> None:
        # paho's __init__ builds its name tables anew per object: these share the empty one's.
        self.__dict__.update(_EMPTY_PUBLISH_PROPERTIES.__dict__)
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        packed: bytes = object.__getattribute__(self, "_packed")
        return packed


_paho_decode_publish: Callable[..., Any] = _packet.decode_publish


def _decode_publish(header: int, packet: bytes | bytearray, protocol: Any) -> Any:
    """paho's PUBLISH decoder, reading the header and properties in place and copying the payload once.

    paho 2.x (``_packet.decode_publish``) peels each field off with ``struct.unpack``, which copies the
    rest of the packet, and its properties parser slices the rest after every property: a 256 KiB
    chunk reply with its four properties was copied about a dozen times on the receiving thread (most
    of that thread's CPU in a model pull). A packet this does not expect goes to paho's decoder, which
    accepts or refuses it as it always did.
    """
    try:
        with memoryview(packet) as view:
            decoded = _read_publish(header, view, protocol)
    except Exception:  # noqa: BLE001 - paho's decoder decides (and raises MalformedPacket)
        decoded = None
    return decoded if decoded is not None else _paho_decode_publish(header, packet, protocol)


def _read_publish(header: int, view: memoryview, protocol: Any) -> Any:
    """The PublishPacket in ``view``, or None when it is truncated or unusual (paho's decoder then)."""
    qos = (header & 0x06) >> 1
    topic_end = 2 + int.from_bytes(view[0:2], "big")
    pos = topic_end + (2 if qos else 0)
    if len(view) < pos or (topic_end == 2 and protocol != paho.MQTTv5):
        return None
    topic = bytes(view[2:topic_end])
    mid = int.from_bytes(view[topic_end:pos], "big") if qos else 0
    properties = None
    if protocol == paho.MQTTv5:
        length, used = VariableByteIntegers.decode(bytes(view[pos : pos + 4]))  # type: ignore[no-untyped-call]
        if pos + used + length > len(view):
            return None
        properties = _read_properties(view[pos + used : pos + used + length])
        if properties is None:
            return None
        pos += used + length
    return _packet.PublishPacket(
        dup=bool(header & 0x08),
        qos=qos,
        retain=bool(header & 0x01),
        topic=topic,
        mid=mid,
        properties=properties,
        payload=bytes(view[pos:]),
    )


#: The PUBLISH properties the core reads itself: identifier -> paho's attribute name and the field's
#: form. Any other (a subscription identifier, one paho does not know) goes to paho's decoder.
_PUBLISH_PROPERTIES = {
    0x01: ("PayloadFormatIndicator", "byte"),
    0x02: ("MessageExpiryInterval", "int4"),
    0x03: ("ContentType", "utf8"),
    0x08: ("ResponseTopic", "utf8"),
    0x09: ("CorrelationData", "binary"),
    0x23: ("TopicAlias", "int2"),
    0x26: ("UserProperty", "pair"),
}


def _read_properties(view: memoryview) -> Properties | None:
    """paho's Properties for a PUBLISH property section (its length already read), or None when a
    property is one paho should judge: unknown, repeated where paho refuses that, or out of range.

    paho's own ``unpack`` scans every property name per property and slices the rest of the section
    after each: about half the receiving thread's Python time per chunk reply, which carries four.
    """
    props = Properties.__new__(Properties)
    values = props.__dict__
    values.update(_EMPTY_PUBLISH_PROPERTIES.__dict__)
    pos, end = 0, len(view)
    while pos < end:
        known = _PUBLISH_PROPERTIES.get(view[pos])
        if known is None:
            return None
        name, form = known
        pos += 1
        value: Any
        if form == "byte":
            value, pos = view[pos], pos + 1
            if value > 1:
                return None
        elif form in {"int2", "int4"}:
            size = 2 if form == "int2" else 4
            if pos + size > end:
                return None
            value, pos = int.from_bytes(view[pos : pos + size], "big"), pos + size
            if value == 0 and form == "int2":
                return None
        elif form == "pair":
            key, pos = _read_field(view, pos, end, text=True)
            text, pos = _read_field(view, pos, end, text=True)
            if key is None or text is None:
                return None
            values.setdefault(name, []).append((key, text))
            continue
        else:
            value, pos = _read_field(view, pos, end, text=form == "utf8")
            if value is None:
                return None
        if name in values:
            return None
        values[name] = value
    return props if pos == end else None


def _read_field(view: memoryview, pos: int, end: int, *, text: bool) -> tuple[Any, int]:
    """A length-prefixed field at ``pos``: (str or bytes, the position after it), or (None, pos) when
    it overruns the section or is text MQTT forbids (not UTF-8, a null, U+FEFF)."""
    stop = pos + 2 + int.from_bytes(view[pos : pos + 2], "big")
    if pos + 2 > end or stop > end:
        return None, pos
    data = bytes(view[pos + 2 : stop])
    if not text:
        return data, stop
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, pos
    if "\x00" in decoded or "\ufeff" in decoded:
        return None, pos
    return decoded, stop


# paho's client calls the decoder through its module; every paho client of the agent is this module's.
# The module is paho's private one: a paho without the names keeps its own decoder.
if hasattr(_packet, "PublishPacket"):
    _packet.decode_publish = _decode_publish


def _inbound(msg: Any) -> InboundMessage:
    """Copy a paho ``MQTTMessage`` (its payload buffer is reused by paho after the callback)."""
    props = getattr(msg, "properties", None)
    return InboundMessage(
        topic=msg.topic,
        payload=bytes(msg.payload),
        qos=int(msg.qos),
        retain=bool(msg.retain),
        response_topic=getattr(props, "ResponseTopic", None),
        correlation_data=getattr(props, "CorrelationData", None),
        user_properties=tuple(tuple(p) for p in getattr(props, "UserProperty", None) or ()),
    )


#: ``quiet_ack(mid)``: True when a successful PUBACK for ``mid`` needs no event (only counting).
QuietAck = Callable[[int], bool]


class MqttCore:
    """One paho client: connect, loop, publish, subscribe; callbacks reported as :data:`Event` s.

    ``single_writer``: only the thread that calls :meth:`loop` ever writes to the socket (publishes
    from other threads only queue and wake the loop); for a user that runs its own network thread.
    Its client reports acknowledgements only (:class:`_AckedOnlyClient`): no event, and no
    ``quiet_ack``, for a QoS 0 write; the user counts QoS 0 messages itself.
    Otherwise :meth:`loop_start` runs paho's thread. ``reconnect`` False: that thread does not connect
    again after the connection is lost (a connection that must not come back on its own).
    """

    def __init__(
        self,
        settings: MqttSettings,
        client_id: str,
        *,
        on_event: Callable[[Event], None],
        on_message: Callable[[InboundMessage], None],
        quiet_ack: QuietAck | None = None,
        on_quiet_ack: Callable[[], None] | None = None,
        single_writer: bool = False,
        reconnect: bool = True,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self._on_event = on_event
        self._on_message = on_message
        self._quiet_ack = quiet_ack
        self._on_quiet_ack = on_quiet_ack
        self._tls_context = _tls_context(settings.tls) if settings.tls is not None else None
        client = _new_paho_client(
            settings,
            client_id,
            tls_context=self._tls_context,
            reconnect=reconnect,
            acked_only=single_writer,
        )
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        if isinstance(client, _AckedOnlyClient):
            client.on_ack = self._cb_publish
        else:
            client.on_publish = self._cb_publish
        client.on_subscribe = self._cb_subscribe
        client.on_message = self._cb_message
        if single_writer:
            # A no-op on purpose: with it set, publish() from any thread only queues the packet and
            # wakes the loop, so exactly one thread ever writes to the socket.
            client.on_socket_register_write = _no_op
        self._client = client

    # -- paho callbacks: report, never raise -----------------------------------------------------------

    def _report_failure(self, callback: str, exc: Exception) -> None:
        with contextlib.suppress(Exception):
            self._on_event(CallbackFailed(callback, repr(exc)))

    def _cb_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        try:
            max_packet = getattr(props, "MaximumPacketSize", None)
            receive_max = getattr(props, "ReceiveMaximum", None)
            self._on_event(ConnAck(int(reason_code.value), str(reason_code), max_packet, receive_max))
        except Exception as exc:  # noqa: BLE001 - nothing may escape into paho's loop
            self._report_failure("on_connect", exc)

    def _cb_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        try:
            self._on_event(Disconnected(str(reason_code), int(reason_code.value)))
        except Exception as exc:  # noqa: BLE001
            self._report_failure("on_disconnect", exc)

    def _cb_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, props: Any) -> None:
        try:
            code = int(reason_code.value)
            # paho's own client "acks" every QoS 0 publish at once: a success nobody waits for is
            # only counted (so is a QoS 1 acknowledgement that ``quiet_ack`` says nobody waits for).
            if code == 0 and self._quiet_ack is not None and self._quiet_ack(mid):
                if self._on_quiet_ack is not None:
                    self._on_quiet_ack()
                return
            self._on_event(PubAck(mid, code, str(reason_code)))
        except Exception as exc:  # noqa: BLE001
            self._report_failure("on_publish", exc)

    def _cb_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, props: Any) -> None:
        try:
            self._on_event(SubAck(mid, tuple(str(rc) for rc in reason_codes if rc.is_failure)))
        except Exception as exc:  # noqa: BLE001
            self._report_failure("on_subscribe", exc)

    def _cb_message(self, client: Any, userdata: Any, msg: Any) -> None:
        try:
            self._on_message(_inbound(msg))
        except Exception as exc:  # noqa: BLE001
            self._report_failure("on_message", exc)

    # -- connection ------------------------------------------------------------------------------------

    def set_limits(self, *, max_inflight: int, max_queued: int = 0) -> None:
        """paho's window of unacknowledged QoS 1 messages, and its queue bound (0 = unbounded)."""
        self._client.max_inflight_messages_set(max_inflight)
        self._client.max_queued_messages_set(max_queued)

    def set_reconnect_delay(self, first_s: float, max_s: float) -> None:
        """paho's own reconnect delays (for :meth:`loop_start` users)."""
        self._client.reconnect_delay_set(first_s, max_s)  # type: ignore[arg-type]  # floats work; stub says int

    def reload_certificate(self) -> None:
        """Load the client certificate and key from their files again: the next connection (not this
        one) presents them. Raises ConfigError (nothing changed) when they do not load or match."""
        tls = self.settings.tls
        if self._tls_context is None or tls is None:
            raise ConfigError("mqtt.tls: no TLS configured, so there is no certificate to reload")
        try:
            _load_client_certificate(self._tls_context, tls)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"mqtt.tls: cannot load the new certificate/key ({exc}); the previous one stays in use"
            ) from exc

    def will_set(self, topic: str, payload: bytes, *, qos: int, retain: bool) -> None:
        self._client.will_set(topic, payload, qos=qos, retain=retain)

    def connect_async(self, *, persistent_session_s: int | None = None) -> None:
        """Remember where to connect; ``persistent_session_s``: keep the broker session that long.

        A persistent session uses clean_start=False: the broker keeps our subscriptions and queued
        QoS 1 messages across restarts (paho's default wipes them on every process start).
        """
        s = self.settings
        if persistent_session_s is None:
            self._client.connect_async(s.host, s.port, keepalive=s.keepalive_s)
            return
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = persistent_session_s
        self._client.connect_async(
            s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=props
        )

    def reconnect(self) -> None:
        """Open the socket and send CONNECT; raises OSError (and ssl/DNS errors) when it cannot."""
        self._client.reconnect()

    def loop(self, timeout: float) -> str | None:
        """One turn of paho's loop on this thread: None when fine, else why the connection is gone."""
        rc = self._client.loop(timeout=timeout)
        return None if rc == MQTTErrorCode.MQTT_ERR_SUCCESS else paho.error_string(rc)

    def loop_start(self) -> None:
        self._client.loop_start()

    def loop_stop(self) -> None:
        self._client.loop_stop()

    def disconnect(self, *, flush_s: float = 0.0, loop_timeout: float = 0.05) -> None:
        """A normal DISCONNECT (the broker discards the Last Will); with ``flush_s``, write it out now."""
        self._client.disconnect()
        end = time.monotonic() + flush_s
        while flush_s > 0 and self._client.want_write() and time.monotonic() < end:
            self._client.loop(timeout=loop_timeout)
        if flush_s > 0:
            self._client.loop(timeout=0)

    # -- traffic ---------------------------------------------------------------------------------------

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int,
        retain: bool = False,
        properties: PublishProperties | None = None,
    ) -> Sent:
        info = self._client.publish(
            topic, payload, qos=qos, retain=retain, properties=properties.to_paho() if properties else None
        )
        outcome = _OUTCOMES.get(info.rc, PublishOutcome.ERROR)
        error = paho.error_string(info.rc) if outcome is PublishOutcome.ERROR else ""
        return Sent(outcome, info.mid, error)

    def subscribe(self, topic_filter: str, qos: int) -> int | None:
        """Send SUBSCRIBE; the mid to wait for, or None when not connected (subscribe on connect)."""
        rc, mid = self._client.subscribe(topic_filter, qos=qos)
        return mid if rc == MQTTErrorCode.MQTT_ERR_SUCCESS else None

    # -- the loop's wake-up pair (single-writer users) -------------------------------------------------

    def rearm_wake(self) -> None:
        CoalescedWake.rearm(self._client)

    def wake_now(self) -> None:
        CoalescedWake.wake_now(self._client)

    def wake(self) -> None:
        """Wake the loop for work another thread left it (at most one wake byte per turn)."""
        CoalescedWake.wake(self._client)


def _no_op(client: Any, userdata: Any, sock: Any) -> None:
    """paho's ``on_socket_register_write``, set on purpose to do nothing (see :class:`MqttCore`)."""
