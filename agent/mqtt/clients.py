"""One way to make a paho client from :class:`MqttSettings`: MQTT 5, TLS, credentials, TCP_NODELAY.

Used by the device link, the operator's service clients and the observer, so every connection
authenticates and tunes its socket the same way.
"""

from __future__ import annotations

import socket
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.errors import ConfigError
from agent.mqtt.settings import MqttSettings
from agent.secret_file import read_secret


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


def new_client(settings: MqttSettings, client_id: str) -> paho.Client:
    """An MQTT 5 paho client with the settings' TLS and credentials; raises ConfigError naming the key."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    tls = settings.tls
    if tls is not None:
        try:
            client.tls_set(
                ca_certs=str(tls.ca_file) if tls.ca_file else None,
                certfile=str(tls.cert_file) if tls.cert_file else None,
                keyfile=str(tls.key_file) if tls.key_file else None,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"mqtt.tls: cannot load the CA/certificate/key ({exc}); check the paths and that "
                "the key matches the certificate"
            ) from exc
        client.tls_insecure_set(tls.insecure)
    if settings.username is not None:
        password = read_secret(settings.password_file) if settings.password_file is not None else None
        client.username_pw_set(settings.username, password)
    client.on_socket_open = _on_socket_open
    return client
