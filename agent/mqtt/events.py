"""What the paho core reports: its callbacks become these small typed events, and a publish a
:class:`Sent`. Plain data, no paho: the link and the service client match on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ConnAck:
    """The broker answered CONNECT; ``max_packet``/``receive_max`` are its CONNACK limits, if any."""

    code: int
    reason: str
    max_packet: int | None
    receive_max: int | None

    @property
    def ok(self) -> bool:
        return self.code < 0x80


#: DISCONNECT reason code "Session taken over": another connection with this client id connected
#: (sent by mosquitto 2.0.15 and later; 2.0.11 closes the socket without it, mosquitto#2607).
SESSION_TAKEN_OVER = 0x8E


@dataclass(frozen=True)
class Disconnected:
    """The connection ended; ``code`` is the reason code (the broker's DISCONNECT, or paho's for a
    lost socket: 0x80 "Unspecified error")."""

    reason: str
    code: int = 0x80

    @property
    def taken_over(self) -> bool:
        return self.code == SESSION_TAKEN_OVER


@dataclass(frozen=True)
class PubAck:
    """A QoS 1 publish was acknowledged (or refused, ``code >= 0x80``); QoS 0 reports one at once."""

    mid: int
    code: int
    reason: str

    @property
    def ok(self) -> bool:
        return self.code < 0x80


@dataclass(frozen=True)
class SubAck:
    mid: int
    failed: tuple[str, ...]


@dataclass(frozen=True)
class CallbackFailed:
    """A callback of ours raised (a bug): reported, never let into paho's loop."""

    callback: str
    error: str


Event = ConnAck | Disconnected | PubAck | SubAck | CallbackFailed


class PublishOutcome(Enum):
    """What paho did with a publish."""

    QUEUED = "queued"  # on the wire or in paho's queue
    NO_CONNECTION = "no_connection"  # QoS 1: kept in paho's queue for the reconnect; QoS 0: dropped
    QUEUE_FULL = "queue_full"  # paho's bounded queue refused it
    ERROR = "error"


@dataclass(frozen=True)
class Sent:
    outcome: PublishOutcome
    mid: int
    error: str = ""
