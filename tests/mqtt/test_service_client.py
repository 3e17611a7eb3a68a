"""The operator client's start(): a refused connection fails at once, naming what the user set."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from agent.demo.broker import Broker, free_port
from agent.errors import TransportError
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings

# Long enough that a client which waits it out instead of failing on the refusal is plainly wrong
# (the assertion is on the message, which names the refusal; not on the time taken).
_PATIENT_S = 20.0


def test_nothing_listening_fails_with_the_reason_and_the_config_keys() -> None:
    settings = MqttSettings(host="127.0.0.1", port=free_port())
    with pytest.raises(TransportError) as info:
        ServiceClient(settings).start(timeout=_PATIENT_S)
    message = str(info.value)
    assert f"127.0.0.1:{settings.port}: Connection refused" in message
    assert "check mqtt.host/port" in message


def test_the_flag_the_user_typed_is_named() -> None:
    settings = MqttSettings(host="127.0.0.1", port=free_port()).with_address_from("--broker")
    with pytest.raises(TransportError) as info:
        ServiceClient(settings).start(timeout=_PATIENT_S)
    assert "check --broker" in str(info.value)
    assert "mqtt.host" not in str(info.value)


def test_refused_credentials_fail_at_once_naming_them(
    broker_factory: Callable[[Sequence[str]], Broker],
) -> None:
    broker = broker_factory(["allow_anonymous false"])
    settings = MqttSettings(host=broker.host, port=broker.port).with_address_from("--broker")
    with pytest.raises(TransportError) as info:
        ServiceClient(settings).start(timeout=_PATIENT_S)
    message = str(info.value)
    assert "refused the connection (Not authorized)" in message
    assert "--username, --password-file" in message


def test_a_reachable_broker_still_connects(broker: Broker) -> None:
    client = ServiceClient(MqttSettings(host=broker.host, port=broker.port)).start(timeout=5.0)
    try:
        assert client.connected
    finally:
        client.stop()


def _mosquitto_version() -> tuple[int, ...]:
    """The installed mosquitto's version, from the first line of ``mosquitto -h``."""
    import re
    import subprocess

    from agent.demo.broker import mosquitto_binary

    out = subprocess.run([mosquitto_binary(), "-h"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"mosquitto version (\d+)\.(\d+)\.(\d+)", out)
    assert found, out
    return tuple(int(part) for part in found.groups())


def test_a_connection_whose_client_id_another_takes_is_told_so_only_where_the_broker_says_it(
    broker: Broker,
) -> None:
    """MQTT 5 asks the broker to send the earlier connection DISCONNECT 0x8E "Session taken over";
    mosquitto does from 2.0.15 (mosquitto#2607). 2.0.11 closes the socket without it: to paho that
    is any lost connection ("Unspecified error"), which is why the lease has a witness connection
    (controller/lease.py)."""
    from uuid import uuid4

    from tests.waiting import wait_until

    settings = MqttSettings(host=broker.host, port=broker.port)
    client_id = f"taken-{uuid4().hex[:8]}"
    first = ServiceClient(settings, client_id=client_id, reconnect=False).start(timeout=5.0)
    second = ServiceClient(settings, client_id=client_id, reconnect=False).start(timeout=5.0)
    try:
        wait_until(lambda: not first.connected, what="the broker to close the earlier connection")
        assert second.connected
        assert first.taken_over is (_mosquitto_version() >= (2, 0, 15))
        assert not second.taken_over
    finally:
        first.stop()
        second.stop()
