"""Socket options for every MQTT connection the agent or the fleet tools open."""

from __future__ import annotations

import socket
from typing import Any


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
