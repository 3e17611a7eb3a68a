"""A plain paho MQTT v5 client for tests: subscribe, collect messages, wait for one, publish.

This is the "other side" of the link under test (an operator or dashboard), deliberately written
without agent code so it cannot share the link's bugs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.waiting import patient


@dataclass(frozen=True)
class Received:
    """One message the probe received."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    message_expiry_s: int | None = None


class Probe:
    """Connects on construction; ``close()`` (or ``with``) disconnects."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: dict[str, Any] | None = None,
        session_expiry_s: int | None = None,
        timeout: float = 10.0,
    ) -> None:
        """``session_expiry_s``: keep the broker session (and messages queued for it) across reconnects."""
        self.messages: list[Received] = []
        self._cond = threading.Condition()
        self._subacks: dict[int, list[int]] = {}
        self._pubacks: dict[int, int] = {}
        self._connected = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"probe-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls is not None:
            self.client.tls_set(**tls)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_publish = self._on_publish
        self.client.reconnect_delay_set(0.1, 0.5)  # type: ignore[arg-type]  # floats work; stub says int
        connect_props = None
        if session_expiry_s is not None:
            connect_props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            connect_props.SessionExpiryInterval = session_expiry_s
        self.client.connect(
            host, port, keepalive=30, clean_start=session_expiry_s is None, properties=connect_props
        )
        self.client.loop_start()
        if not self._connected.wait(patient(timeout)):
            self.client.disconnect()
            self.client.loop_stop()
            raise TimeoutError(f"probe could not connect to {host}:{port}")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        if not reason_code.is_failure:
            self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        props = getattr(msg, "properties", None)
        received = Received(
            topic=msg.topic,
            payload=bytes(msg.payload),
            qos=msg.qos,
            retain=bool(msg.retain),
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=getattr(props, "CorrelationData", None),
            user_properties=tuple(getattr(props, "UserProperty", ()) or ()),
            message_expiry_s=getattr(props, "MessageExpiryInterval", None),
        )
        with self._cond:
            self.messages.append(received)
            self._cond.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, props: Any) -> None:
        with self._cond:
            self._subacks[mid] = [int(rc.value) for rc in reason_codes]
            self._cond.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, props: Any) -> None:
        with self._cond:
            self._pubacks[mid] = int(reason_code.value)
            self._cond.notify_all()

    def subscribe(self, topic_filter: str, qos: int = 1, timeout: float = 10.0) -> None:
        """Subscribe and wait for the SUBACK (so nothing published afterwards is missed)."""
        _, mid = self.client.subscribe(topic_filter, qos=qos)
        with self._cond:
            if not self._cond.wait_for(lambda: mid in self._subacks, patient(timeout)):
                raise TimeoutError(f"no SUBACK for {topic_filter}")

    def subscribe_many(self, topic_filters: list[str], qos: int = 1, timeout: float = 30.0) -> list[int]:
        """Subscribe to all of ``topic_filters``, a few hundred per SUBSCRIBE; the SUBACK reason codes."""
        codes: list[int] = []
        for start in range(0, len(topic_filters), 200):
            batch = [(f, qos) for f in topic_filters[start : start + 200]]
            _, sent = self.client.subscribe(batch)
            assert sent is not None, "not connected"
            mid: int = sent
            with self._cond:
                if not self._cond.wait_for(lambda: mid in self._subacks, patient(timeout)):  # noqa: B023 - waited on here
                    raise TimeoutError(f"no SUBACK for {len(batch)} filters from {batch[0][0]}")
                codes += self._subacks[mid]
        return codes

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        qos: int = 1,
        retain: bool = False,
        *,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        user_properties: list[tuple[str, str]] | None = None,
        timeout: float = 10.0,
    ) -> int:
        """Publish; for QoS 1 wait for the PUBACK and return its reason code (0 for QoS 0)."""
        props: Properties | None = None
        if response_topic or correlation_data or user_properties:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation_data:
                props.CorrelationData = correlation_data
            if user_properties:
                props.UserProperty = user_properties
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if qos == 0:
            return 0
        with self._cond:
            if not self._cond.wait_for(lambda: info.mid in self._pubacks, patient(timeout)):
                raise TimeoutError(f"no PUBACK for {topic}")
            return self._pubacks[info.mid]

    def snapshot(self) -> list[Received]:
        """A copy of everything received so far."""
        with self._cond:
            return list(self.messages)

    def on_topic(self, topic: str) -> list[Received]:
        """Messages received on exactly ``topic``."""
        return [m for m in self.snapshot() if m.topic == topic]

    def wait_for(self, predicate: Callable[[list[Received]], bool], timeout: float = 10.0) -> list[Received]:
        """Wait until ``predicate(messages)`` is true; return the messages; raise TimeoutError if never."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.messages), patient(timeout)):
                topics = sorted({m.topic for m in self.messages})
                raise TimeoutError(f"condition not met within {timeout}s; {len(self.messages)} on {topics}")
            return list(self.messages)

    def wait_for_count(self, topic: str, count: int, timeout: float = 10.0) -> list[Received]:
        """Wait until at least ``count`` messages arrived on ``topic``; return those."""
        self.wait_for(lambda ms: sum(1 for m in ms if m.topic == topic) >= count, timeout)
        return self.on_topic(topic)

    def wait_for_more(self, topic: str, more: int, timeout: float = 10.0) -> list[Received]:
        """Wait until ``more`` messages arrived on ``topic`` beyond those already received."""
        return self.wait_for_count(topic, len(self.on_topic(topic)) + more, timeout)

    def clear(self) -> None:
        """Forget received messages."""
        with self._cond:
            self.messages.clear()

    def settle(self, seconds: float = 0.3) -> None:
        """Give in-flight messages a moment (only to assert that something did NOT arrive)."""
        time.sleep(seconds)

    def close(self) -> None:
        """Disconnect and stop the network thread."""
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
