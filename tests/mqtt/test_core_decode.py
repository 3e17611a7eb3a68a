"""The core's PUBLISH decoder (agent/mqtt/core.py ``_decode_publish``) against paho's own.

paho's decoder copies the payload once per field and property; the core's reads them in place. For
every shape of packet both must give the same result, and a packet the core's does not expect must
get paho's answer (its MalformedPacket included). Then a real chunk-reply-sized message through a
real broker arrives whole, properties and all.
"""

from __future__ import annotations

import os
import struct
import threading
import uuid

import paho.mqtt.client as paho
import pytest
from paho.mqtt import _packet
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from agent.demo.broker import Broker
from agent.mqtt import core
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from tests.waiting import patient


def _properties() -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = b"pull:17"
    props.UserProperty = ("index", "3")
    props.UserProperty = ("sha256", "ab" * 32)
    props.MessageExpiryInterval = 120
    return props


def _body(topic: bytes, payload: bytes, *, qos: int, mid: int, props: Properties | None, v5: bool) -> bytes:
    body = struct.pack("!H", len(topic)) + topic
    if qos:
        body += struct.pack("!H", mid)
    if v5:
        body += props.pack() if props is not None else b"\x00"  # type: ignore[no-untyped-call]
    return body + payload


def _same(a: _packet.PublishPacket, b: _packet.PublishPacket) -> None:
    assert (a.dup, a.qos, a.retain, a.topic, a.mid, bytes(a.payload)) == (
        b.dup,
        b.qos,
        b.retain,
        b.topic,
        b.mid,
        bytes(b.payload),
    )
    assert type(a.payload) is type(b.payload) is bytes
    assert str(a.properties) == str(b.properties)


@pytest.mark.parametrize("v5", [True, False])
@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("with_props", [True, False])
@pytest.mark.parametrize("payload", [b"", b"x", os.urandom(256 * 1024)])
def test_every_packet_shape_decodes_as_paho_decodes_it(
    v5: bool, qos: int, with_props: bool, payload: bytes
) -> None:
    protocol = paho.MQTTv5 if v5 else paho.MQTTv311
    header = 0x30 | (qos << 1) | 0x08 | 0x01
    body = _body(
        b"fleet/v1/dev/down/xfer/abc",
        payload,
        qos=qos,
        mid=4242,
        props=_properties() if with_props else None,
        v5=v5,
    )
    _same(
        core._decode_publish(header, bytearray(body), protocol),
        core._paho_decode_publish(header, body, protocol),
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",  # nothing at all
        b"\x00",  # half a topic length
        b"\x00\x09top",  # topic longer than the packet
        b"\x00\x03top\x00",  # QoS 1 without its whole message id
        b"\x00\x03top\x00\x01\x7f\x01",  # properties longer than the packet
        b"\x00\x03top\x00\x01\x02\x63\x00",  # a property paho does not know
    ],
)
def test_a_malformed_packet_gets_pahos_answer(body: bytes) -> None:
    header = 0x32  # QoS 1
    with pytest.raises(MalformedPacket):
        core._paho_decode_publish(header, body, paho.MQTTv5)
    with pytest.raises(MalformedPacket):
        core._decode_publish(header, bytearray(body), paho.MQTTv5)


def test_an_empty_topic_outside_mqtt5_is_refused_as_paho_refuses_it() -> None:
    with pytest.raises(MalformedPacket):
        core._decode_publish(0x30, bytearray(b"\x00\x00payload"), paho.MQTTv311)


def test_paho_calls_the_cores_decoder() -> None:
    assert _packet.decode_publish is core._decode_publish


def test_a_chunk_sized_reply_arrives_whole_with_its_properties(broker: Broker) -> None:
    topic = f"decode/{uuid.uuid4().hex[:8]}"
    payload = os.urandom(1024 * 1024)
    got: list[InboundMessage] = []
    arrived = threading.Event()

    def on_message(message: InboundMessage) -> None:
        got.append(message)
        arrived.set()

    settings = MqttSettings(host=broker.host, port=broker.port, max_payload_bytes=2 * 1024 * 1024)
    receiver = ServiceClient(settings, handler=on_message).start()
    sender = ServiceClient(settings).start()
    try:
        receiver.subscribe(topic, qos=1)
        properties = PublishProperties(
            correlation_data=b"pull:1",
            user_properties=(("index", "7"), ("sha256", "cd" * 32)),
            message_expiry_s=60,
        )
        sender.publish(topic, payload, qos=1, properties=properties)
        assert arrived.wait(patient(10.0))
    finally:
        sender.stop()
        receiver.stop()
    [message] = got
    assert message.payload == payload
    assert message.correlation_data == b"pull:1"
    assert message.user_properties == (("index", "7"), ("sha256", "cd" * 32))


@pytest.mark.parametrize(
    "properties",
    [
        PublishProperties(),
        PublishProperties(message_expiry_s=120),
        PublishProperties(response_topic="fleet/v1/dev/down/xfer/" + "a" * 64, correlation_data=b"p:1"),
        PublishProperties(
            correlation_data=bytes(range(256)),
            user_properties=(("index", "3"), ("sha256", "ab" * 32), ("ä", "ü" * 100)),
            message_expiry_s=2**32 - 1,
        ),
        PublishProperties(user_properties=(("k", "v" * 200),)),  # a length past one VBI byte
    ],
)
def test_publish_properties_pack_as_paho_packs_them(properties: PublishProperties) -> None:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if properties.response_topic is not None:
        props.ResponseTopic = properties.response_topic
    if properties.correlation_data is not None:
        props.CorrelationData = properties.correlation_data
    if properties.user_properties:
        props.UserProperty = list(properties.user_properties)
    if properties.message_expiry_s is not None:
        props.MessageExpiryInterval = properties.message_expiry_s
    assert properties.to_paho().pack() == props.pack()  # type: ignore[no-untyped-call]


def _section(*fields: bytes) -> bytes:
    """A property section (its length, then the fields) as it would sit in a PUBLISH."""
    body = b"".join(fields)
    return core._variable_int(len(body)) + body


def _text(value: bytes) -> bytes:
    return struct.pack("!H", len(value)) + value


@pytest.mark.parametrize(
    "section",
    [
        _section(),
        _section(b"\x01\x00"),  # payload format 0 (unspecified bytes)
        _section(b"\x01\x01"),  # payload format 1 (UTF-8)
        _section(b"\x02" + struct.pack("!L", 2**32 - 1)),
        _section(b"\x03" + _text(b"application/octet-stream")),
        _section(b"\x08" + _text("fleet/v1/dév/down/xfer/ab".encode())),
        _section(b"\x09" + _text(b"")),  # empty correlation data
        _section(b"\x09" + _text(bytes(range(256)))),
        _section(b"\x23" + struct.pack("!H", 7)),
        _section(*(b"\x26" + _text(k) + _text(v) for k, v in [(b"i", b"3"), (b"i", b"4"), (b"", b"")])),
        _section(b"\x0b\x05"),  # a subscription identifier: left to paho
        _section(b"\x0b\x05", b"\x26" + _text(b"a") + _text(b"b")),
        # every form at once, in an unusual order
        _section(
            b"\x26" + _text("ä".encode()) + _text("ü".encode() * 300),
            b"\x09" + _text(b"pull:9"),
            b"\x02\x00\x00\x00\x78",
            b"\x08" + _text(b"r/t"),
            b"\x01\x00",
        ),
        # refused by paho: the core must not accept what paho refuses, nor refuse differently
        _section(b"\x02\x00\x00\x00\x01", b"\x02\x00\x00\x00\x02"),  # a single property twice
        _section(b"\x01\x02"),  # payload format out of range
        _section(b"\x23\x00\x00"),  # topic alias 0
        _section(b"\x08" + _text(b"a\x00b")),  # a null in UTF-8 text
        _section(b"\x08" + _text("a\ufeffb".encode())),  # U+FEFF in UTF-8 text
        _section(b"\x08" + _text(b"\xff\xfe")),  # not UTF-8
        _section(b"\x08" + _text(b"\xed\xa0\x80")),  # an encoded surrogate
        _section(b"\x26" + _text(b"k")),  # a user property without its value
        _section(b"\x08\x00\x05ab"),  # a string longer than the section
        _section(b"\x02\x00\x01"),  # a four-byte integer cut short
        _section(b"\x11\x00\x00\x00\x01"),  # session expiry: not a PUBLISH property
        _section(b"\x7f\x00"),  # no property at all
    ],
)
def test_every_property_reads_as_paho_reads_it_or_is_refused_as_paho_refuses_it(section: bytes) -> None:
    body = b"\x00\x03top\x12\x34" + section + b"payload"

    def outcome(decode: object) -> tuple[str, str]:
        try:
            packet = decode(0x32, bytearray(body), paho.MQTTv5)  # type: ignore[operator]
        except Exception as exc:  # which exception is what is compared
            return "refused", type(exc).__name__
        return "read", f"{packet.properties} {bytes(packet.payload)!r} {packet.mid}"

    assert outcome(core._decode_publish) == outcome(core._paho_decode_publish)


def test_a_chunk_replys_properties_are_read_by_the_core_not_handed_to_paho() -> None:
    section = _properties().pack()  # type: ignore[no-untyped-call]
    length, used = VariableByteIntegers.decode(section)  # type: ignore[no-untyped-call]
    props = core._read_properties(memoryview(section)[used : used + length])
    assert props is not None
    # paho sets each property as an attribute of its own name, which its types do not declare
    assert props.UserProperty == [("index", "3"), ("sha256", "ab" * 32)]  # type: ignore[attr-defined]
    assert (props.CorrelationData, props.MessageExpiryInterval) == (b"pull:17", 120)  # type: ignore[attr-defined]
