"""The paho 2.x traps the link works around, shown on plain paho against a real broker.

If one of these starts failing after a paho upgrade, the trap is gone: re-check the workaround in
agent/mqtt/core.py (and the link, agent/mqtt/link.py) before removing it.
"""

from __future__ import annotations

import threading
import uuid

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.demo.broker import Broker
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until


def _client(client_id: str) -> mqtt.Client:
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_exception_in_callback_kills_paho_thread_while_is_connected_says_true(broker: Broker) -> None:
    client_id = f"trap-{uuid.uuid4().hex[:8]}"
    topic = f"trap/{client_id}"
    client = _client(client_id)

    def raising(*args: object) -> None:
        raise ZeroDivisionError("bug in a user callback")

    client.on_message = raising
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        wait_until(client.is_connected, what="connect")
        subscribed = threading.Event()
        client.on_subscribe = lambda *a: subscribed.set()
        client.subscribe(topic, qos=1)
        assert subscribed.wait(patient(5))
        network_thread = client._thread
        assert network_thread is not None
        with Probe(broker.host, broker.port) as probe:
            probe.publish(topic, b"x")
        # Join it here, so the thread's exception is reported inside this test (where it is expected).
        network_thread.join(patient(5))
        assert not network_thread.is_alive()
        assert client._thread is None
        assert client.is_connected()  # stale: nothing reads the socket any more
    finally:
        client.loop_stop()


def test_wait_for_publish_raises_for_a_message_queued_offline_and_delivered_later(
    private_broker: Broker,
) -> None:
    client = _client(f"trap-{uuid.uuid4().hex[:8]}")
    acked = threading.Event()
    client.on_publish = lambda *a: acked.set()
    client.reconnect_delay_set(0.05, 0.2)  # type: ignore[arg-type]  # floats work; stub says int
    private_broker.stop()
    client.connect_async(private_broker.host, private_broker.port)
    client.loop_start()
    try:
        info = client.publish("trap/offline", b"queued", qos=1)  # held in paho's memory
        assert info.rc == mqtt.MQTT_ERR_NO_CONN
        private_broker.start()
        assert acked.wait(patient(10))  # on_publish says it was delivered ...
        with pytest.raises(RuntimeError):
            info.wait_for_publish(timeout=patient(1))  # ... wait_for_publish still raises
    finally:
        client.loop_stop()
