"""One device's own target as the broker holds it: the desired state the operator side published
(retained ``down/desired/{target}``) and what the device reports running (its retained ``up/info``).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from pydantic import ValidationError

from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET, TargetInfo
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.protocol.messages import InfoMessage, ProtocolError, decode
from agent.protocol.topics import Topics


@dataclass(frozen=True)
class TargetState:
    """What is desired for one target of one device, and what it runs (None: nothing retained)."""

    device: str
    target: str
    desired: DeployManifest | None
    reported: TargetInfo | None
    #: Why a retained message could not be read (it is then left out, never guessed at).
    problems: tuple[str, ...] = ()


def read_target_state(
    settings: MqttSettings, device: str, target: str, *, quiet_s: float = 0.5, max_wait_s: float = 5.0
) -> TargetState:
    """The retained desired state of ``target`` (``_config`` or ``_agent``) and ``device``'s report of it.

    Raises TransportError when the broker cannot be reached.
    """
    if target not in (CONFIG_TARGET, AGENT_TARGET):
        raise ValueError(f"{target!r} is not one of the device's own targets")
    topics = Topics(settings.prefix, device)
    arrivals: queue.Queue[InboundMessage] = queue.Queue()
    client = ServiceClient(settings, handler=arrivals.put)
    client.start(max_wait_s * 2)
    found: dict[str, bytes] = {}
    try:
        for topic in (topics.desired(target), topics.info):
            client.subscribe(topic, qos=1, timeout=max_wait_s * 2)
        deadline = time.monotonic() + max_wait_s
        while len(found) < 2 and (left := deadline - time.monotonic()) > 0:
            try:
                message = arrivals.get(timeout=min(quiet_s, left))
            except queue.Empty:
                break
            if message.retain and message.payload:
                found[message.topic] = message.payload
    finally:
        client.stop()
    problems = []
    desired = None
    if (payload := found.get(topics.desired(target))) is not None:
        try:
            desired = DeployManifest.model_validate_json(SignedManifest.model_validate_json(payload).manifest)
        except ValidationError as exc:
            problems.append(f"desired state: {exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}")
    reported = None
    if (payload := found.get(topics.info)) is not None:
        try:
            info = decode(InfoMessage, payload)
            reported = info.config if target == CONFIG_TARGET else info.agent_release
        except ProtocolError as exc:
            problems.append(f"up/info: {exc}")
    return TargetState(device, target, desired, reported, tuple(problems))
