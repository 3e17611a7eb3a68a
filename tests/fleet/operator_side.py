"""Shared parts of the fleet tests (no tests here): a unique prefix per test, operator settings."""

from __future__ import annotations

import uuid
from pathlib import Path

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import InfoMessage, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.mqtt_probe import Probe


def unique_prefix() -> str:
    """A topic prefix of its own, so tests sharing the session broker never see each other."""
    return f"t{uuid.uuid4().hex[:8]}/v1"


def operator_settings(broker: Broker, prefix: str) -> MqttSettings:
    return MqttSettings(
        host=broker.host, port=broker.port, prefix=prefix, reconnect_min_s=0.05, reconnect_max_s=0.3
    )


def tiny_model(path: Path) -> Path:
    """A small real ONNX classifier (a few KiB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_classifier(path, input_size=32, num_classes=4, seed=3)


def unsigned_deploy(model: Path) -> list[str]:
    """``fleet deploy MODEL`` of version 1 to device d1's slot cls, unsigned: the flags a test of
    the deploy command's own flags starts from (nothing is sent when those flags are refused)."""
    return ["fleet", "deploy", str(model), "--device", "d1", "--slot", "cls", "--version", "1", "--unsigned"]


def announce(probe: Probe, prefix: str, *devices: str) -> None:
    """Publish each device's retained ``up/status`` (online) and ``up/info`` (no slot, no stream), as
    a connected agent does. Without the info, every operator command that reads the fleet's retained
    messages (``fleet deploy`` looking up the slot's model id) waited its whole ``--retained-wait``
    (5 s) for an online device's info that never came."""
    for device in devices:
        topics = Topics(prefix, device)
        status = StatusMessage(state="online", session=1, agent_version="test")
        probe.publish(topics.status, encode(status), retain=True)
        info = InfoMessage(
            device_id=device, agent_version="test", platform={}, labels={}, backends={}, slots={}, streams=[]
        )
        probe.publish(topics.info, encode(info), retain=True)
