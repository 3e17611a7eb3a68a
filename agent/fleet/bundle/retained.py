"""What the controller publishes for a device, read back from the broker: its retained desired states
(``{prefix}/{device}/down/desired/{target}``) and the fleet's retained root chain (``_trust/root``),
with the device's retained ``up/info`` (its platform picks the shared engines a bundle carries).

A bundle carries exactly these payloads, so the device checks the same bytes it would have been sent,
and when it connects again the broker's retained states are the ones it already ran.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.errors import UsageError
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.topics import Topics, trust_root


@dataclass
class Published:
    """The retained payloads: per device and target, and the root chain (None: the fleet has none)."""

    desired: dict[str, dict[str, bytes]] = field(default_factory=dict)
    root_chain: bytes | None = None
    #: Per device, its retained ``up/info`` payload (absent: the device never reported).
    info: dict[str, bytes] = field(default_factory=dict)


def read_published(
    settings: MqttSettings, devices: Sequence[str], *, quiet_s: float = 0.5, timeout: float = 10.0
) -> Published:
    """The retained desired states of ``devices`` and the root chain; waits until the broker has been
    quiet ``quiet_s`` after the subscriptions (retained messages come right after each SUBACK).

    Raises UsageError naming a device with no desired state; TransportError when the broker cannot
    be reached.
    """
    arrivals: queue.Queue[InboundMessage] = queue.Queue()
    client = ServiceClient(settings, handler=arrivals.put)
    client.start(timeout)
    published = Published()
    bases = {f"{settings.prefix}/{device}/down/desired/": device for device in devices}
    root_topic = trust_root(settings.prefix)
    infos = {Topics(settings.prefix, device).info: device for device in devices}
    try:
        client.subscribe(root_topic, qos=1, timeout=timeout)
        for device in devices:
            client.subscribe(Topics(settings.prefix, device).desired_filter, qos=1, timeout=timeout)
            client.subscribe(Topics(settings.prefix, device).info, qos=1, timeout=timeout)
        while True:
            try:
                message = arrivals.get(timeout=quiet_s)
            except queue.Empty:
                break
            if not message.retain or not message.payload:
                continue  # a cleared topic, or a live publish racing the read
            if message.topic == root_topic:
                published.root_chain = message.payload
                continue
            if message.topic in infos:
                published.info[infos[message.topic]] = message.payload
                continue
            base, _, target = message.topic.rpartition("/")
            owner = bases.get(base + "/")
            if owner is not None:
                published.desired.setdefault(owner, {})[target] = message.payload
    finally:
        client.stop()
    missing = [device for device in devices if not published.desired.get(device)]
    if missing:
        raise UsageError(
            f"no desired state is retained for {', '.join(missing)} on {settings.host}:{settings.port} "
            f"(prefix {settings.prefix!r}); deploy to the device first (`edge-agent fleet deploy` or a "
            "rollout), then bundle what the controller published"
        )
    return published
