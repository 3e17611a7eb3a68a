"""The prefix's lease claim as anyone reads it: who holds the prefix (:func:`read_lease`), in words
(:func:`describe`), whether that holder is a process of this host that is gone
(:func:`holder_is_gone`), and the holder's client id (:func:`lease_client_id`).
:mod:`agent.fleet.controller.lease` is the holder's side.

Reading the lease needs no clock: the reader subscribes to the lease topic and to an echo topic of
its own, then publishes to the echo; the broker sends a retained claim before the echo, so once the
echo is back, no claim seen means none exists.

A holder of this host that is gone while the broker still counts it connected (the host restarted
after a power cut faster than the keep-alive runs out) is recognised by host name and pid, and its
claim is taken at once.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
import time

from agent.errors import AgentError, TransportError
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import ControllerLease, ProtocolError, decode
from agent.protocol.topics import ControllerTopics


class LeaseHeldError(AgentError):
    """Another controller holds the prefix (the message names it)."""

    code = "lease_held"


def lease_client_id(prefix: str, secret: bytes | None) -> str:
    """The client id of the prefix's lease holder: a keyed hash of the prefix (the plain prefix
    for an unsigned test fleet, which has no key)."""
    if secret is None:
        return f"edge-fleet-controller:{prefix}"
    digest = hashlib.blake2b(prefix.encode(), key=hashlib.sha256(secret).digest(), digest_size=12)
    return f"edge-fleet-controller:{digest.hexdigest()}"


def describe(claim: ControllerLease) -> str:
    """The holder in words, for the one line a refused controller prints."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(claim.since))
    return (
        f"controller {claim.holder} (pid {claim.pid} on {claim.host}, "
        f"state_dir {claim.state_dir}, since {since})"
    )


def read_lease(settings: MqttSettings, timeout: float = 10.0) -> ControllerLease | None:
    """The prefix's current claim (None: free). LeaseHeldError when the retained message is no claim."""
    topics = ControllerTopics(settings.prefix)
    reader = f"lease-reader-{secrets.token_hex(6)}"
    echo = topics.lease_echo(reader)
    payloads: list[bytes] = []
    echoed = threading.Event()

    def on_message(message: InboundMessage) -> None:
        if message.topic == topics.lease:
            payloads.append(message.payload)
        elif message.topic == echo:
            echoed.set()

    client = ServiceClient(settings, client_id=reader, handler=on_message)
    client.start(timeout)
    try:
        client.subscribe(topics.lease, qos=1, timeout=timeout)
        client.subscribe(echo, qos=1, timeout=timeout)
        client.publish(echo, b"echo", qos=1)
        if not echoed.wait(timeout):
            raise TransportError(f"the broker did not echo {echo} within {timeout:.0f}s")
    finally:
        client.stop()
    return claim_of(payloads[-1] if payloads else b"", topics.lease)


def claim_of(payload: bytes, topic: str) -> ControllerLease | None:
    """The claim in a lease message (None: an empty one, nobody holds the prefix)."""
    if not payload:
        return None
    try:
        return decode(ControllerLease, payload)
    except ProtocolError as exc:
        raise LeaseHeldError(
            f"the retained message on {topic} is not a controller lease ({exc}); if no controller runs "
            f"on this prefix, clear it: mosquitto_pub -r -n -t '{topic}'"
        ) from exc


def holder_is_gone(claim: ControllerLease) -> bool:
    """True for a claim whose holder was a process of this host that no longer exists."""
    if claim.host != socket.gethostname() or claim.pid == os.getpid():
        return False
    try:
        os.kill(claim.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False
