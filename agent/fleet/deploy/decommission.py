"""``edge-agent fleet decommission DEVICE``: clear a device's retained topics, so the operator side
forgets it.

A device leaves retained messages on the broker that outlive it: its ``up/status`` (online, or the
Last Will's offline), its ``up/info``, and the signed desired state of each slot an operator
deployed to it (``down/desired/{slot}``). A device taken out of service keeps appearing in
``fleet status``, the controller's console and ``/metrics`` until they are gone. This clears each
one that is retained (an empty retained payload deletes a retained message, MQTT 3.3.1.3); the
controller's fleet view forgets a device whose retained status is cleared
(:meth:`agent.fleet.view.live.FleetView.apply`).

A device whose status says online is refused: its agent would announce itself again at its next
connection, and its desired states are what it serves. Stop its agent first, or pass ``force``
(a device that is gone without its Last Will having reached the broker still reads online).

Given the fleet's CA directory, every certificate of the device is revoked too, once its topics
are cleared: the CRL and the devices ACL are rewritten and the broker told to reload them, so the
device cannot come back with the certificate it holds (docs/enrollment.md, "Revocation").
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agent.errors import AgentError
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.deploy.manifest import check_device_ids
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import ProtocolError, StatusMessage, decode
from agent.protocol.topics import Topics


class DecommissionError(AgentError):
    """A decommission refused: the device is online (its agent runs), or the broker did not ack."""

    code = "decommission_refused"


@dataclass(frozen=True)
class Decommissioned:
    """What a decommission did: the device, what its retained status said, the topics cleared."""

    device: str
    state: str  # online | offline | unknown (no retained status, or a malformed one)
    cleared: tuple[str, ...]
    revoked: tuple[str, ...] = ()  # serials of the certificates revoked (with a CA directory)
    broker: str | None = None  # what telling the broker to reload its CRL did, or what to do

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"device": self.device, "state": self.state, "cleared": list(self.cleared)}
        if self.broker is not None:  # revoked with a CA directory
            out |= {"revoked": list(self.revoked), "broker": self.broker}
        return out


def decommission(
    settings: MqttSettings,
    device: str,
    *,
    force: bool = False,
    quiet_s: float = 0.5,
    max_wait_s: float = 5.0,
    timeout: float = 10.0,
    ca_dir: Path | None = None,
) -> Decommissioned:
    """Clear ``device``'s retained status, info and desired states on the broker; with ``ca_dir``,
    then revoke its certificates and tell the broker (:class:`DeviceAuthority`).

    Reads what is retained first (until ``quiet_s`` passes without a message, at most
    ``max_wait_s``), refuses an online device unless ``force``, then publishes an empty retained
    payload to each retained topic found (and to status and info in any case) and waits for the
    broker's acknowledgements. Nothing retained: nothing is published, ``cleared`` is empty.
    Raises ConfigError for an id that is not one topic level,
    DecommissionError when refused, TransportError when the broker cannot be reached.
    """
    check_device_ids([device])
    done = _clear_retained(
        settings, device, force=force, quiet_s=quiet_s, max_wait_s=max_wait_s, timeout=timeout
    )
    if ca_dir is None:
        return done
    authority = DeviceAuthority.load(ca_dir)
    revoked = authority.revoke_device(device, "decommissioned", tell=False)
    return replace(done, revoked=tuple(revoked), broker=authority.tell_broker().line)


def _clear_retained(
    settings: MqttSettings, device: str, *, force: bool, quiet_s: float, max_wait_s: float, timeout: float
) -> Decommissioned:
    topics = Topics(settings.prefix, device)
    arrivals: queue.Queue[InboundMessage] = queue.Queue()
    client = ServiceClient(settings, handler=arrivals.put)
    client.start(timeout)
    try:
        for topic_filter in (topics.status, topics.info, topics.desired_filter):
            client.subscribe(topic_filter, qos=1, timeout=timeout)
        retained = _retained(arrivals, quiet_s, max_wait_s)
        if not retained:
            return Decommissioned(device, "unknown", ())  # nothing to clear: a typo, or done already
        state = _state(retained.get(topics.status))
        if state == "online" and not force:
            raise DecommissionError(
                f"device {device} is online: its agent would announce itself again; stop it first "
                "(or force it, for a device that is gone without its Last Will reaching the broker)"
            )
        cleared = tuple(sorted({topics.status, topics.info, *retained}))
        for topic in cleared:
            client.publish(topic, b"", qos=1, retain=True)
        if not client.wait_published(timeout):
            raise DecommissionError(f"the broker did not acknowledge clearing {device}'s retained topics")
    finally:
        client.stop()
    return Decommissioned(device, state, cleared)


def _retained(arrivals: queue.Queue[InboundMessage], quiet_s: float, max_wait_s: float) -> dict[str, bytes]:
    """The retained messages delivered on subscribing (topic -> payload), until the broker is quiet."""
    found: dict[str, bytes] = {}
    deadline = time.monotonic() + max_wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = arrivals.get(timeout=min(quiet_s, left))
        except queue.Empty:
            break
        if message.retain and message.payload:
            found[message.topic] = message.payload
    return found


def _state(payload: bytes | None) -> str:
    if payload is None:
        return "unknown"
    try:
        return decode(StatusMessage, payload).state
    except ProtocolError:
        return "unknown"
