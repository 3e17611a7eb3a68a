"""Shared parts of the transfer tests (no tests here): random models, a device link, chunk servers.

Everything is real: a mosquitto broker, an :class:`MqttLink` with its spool for the device, a
:class:`ChunkServer` for the operator side. Each rig uses its own topic prefix, so tests sharing
the session broker never see each other's requests (the servers' shared subscription included).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from agent.delivery.settings import DeliveryConfig
from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import DeployManifest, ModelSourceRef, build_manifest
from agent.protocol.topics import Topics
from agent.spool.queue import Spool

KIB = 1024
MIB = 1024 * KIB


def random_model(path: Path, size: int) -> Path:
    """A file of ``size`` random bytes (the transfer does not care what a model contains)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def manifest_for(
    model: Path,
    chunk_size: int,
    *,
    sources: list[ModelSourceRef] | None = None,
    device: str | None = None,
) -> DeployManifest:
    """A manifest for ``model`` made by the real manifest builder."""
    return build_manifest(
        model,
        job_id=f"job-{uuid.uuid4().hex[:8]}",
        sequence=1,
        slot="main",
        model_id="random",
        version="1",
        chunk_size=chunk_size,
        sources=sources,
        device=device,
    )


def delivery_config(**overrides: Any) -> DeliveryConfig:
    """Delivery settings for tests: small window, short timeouts unless overridden."""
    values: dict[str, Any] = {"chunk_window": 4, "chunk_timeout_s": 2.0, "job_deadline_s": 60.0}
    values.update(overrides)
    return DeliveryConfig(**values)


def mqtt_settings(broker: Broker, prefix: str, **overrides: Any) -> MqttSettings:
    """Settings for a test client: quick reconnects, chunks up to 2 MiB."""
    values: dict[str, Any] = {
        "host": broker.host,
        "port": broker.port,
        "prefix": prefix,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.3,
        "keepalive_s": 5,
        "max_payload_bytes": 2 * MIB,
    }
    values.update(overrides)
    return MqttSettings(**values)


class Slow(ChunkServer):
    """Takes ``delay_s`` per chunk (a slow uplink, or a server busy with a whole fleet)."""

    delay_s = 0.05

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        time.sleep(self.delay_s)
        return [(index, data)]


class Device:
    """A device's side of the transfer: a started :class:`MqttLink` (with spool) and its topics."""

    def __init__(self, broker: Broker, prefix: str, device_id: str, state_dir: Path) -> None:
        self.id = device_id
        self.topics = Topics(prefix, device_id)
        self.part_dir = state_dir / "partial"
        self.spool = Spool(state_dir / "spool.sqlite")
        self.link = MqttLink(
            mqtt_settings(broker, prefix),
            client_id=device_id,
            status_topic=self.topics.status,
            agent_version="0.0.test",
            spool=self.spool,
        )
        self.link.start()
        assert self.link.wait_connected(10), f"device {device_id} did not connect"

    def close(self) -> None:
        self.link.stop(timeout=1.0)
        self.spool.close()


class Rig:
    """Devices and chunk servers on one broker under a prefix of their own; ``close`` stops all."""

    def __init__(self, broker: Broker, tmp_path: Path) -> None:
        self.broker = broker
        self.tmp_path = tmp_path
        self.prefix = f"t{uuid.uuid4().hex[:8]}/v1"
        self.group = f"g{uuid.uuid4().hex[:6]}"
        self._devices: list[Device] = []
        self._servers: list[ChunkServer] = []

    def device(self, name: str | None = None) -> Device:
        device_id = name or f"dev-{uuid.uuid4().hex[:8]}"
        dev = Device(self.broker, self.prefix, device_id, self.tmp_path / device_id)
        self._devices.append(dev)
        return dev

    def server(self, cls: type[ChunkServer] = ChunkServer, **kwargs: Any) -> ChunkServer:
        server = cls(mqtt_settings(self.broker, self.prefix), group=self.group, **kwargs)
        self._servers.append(server)
        return server.start()

    def close(self) -> None:
        for dev in self._devices:
            dev.close()
        for server in self._servers:
            server.stop(timeout=0.5)
