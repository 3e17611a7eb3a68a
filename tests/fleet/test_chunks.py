"""ChunkServer on a real mosquitto, driven by a plain paho probe playing the device.

The probe (tests/mqtt_probe.py) shares no code with the agent, so a request/response mistake on
either side shows up here.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.delivery.manifest import DeployManifest
from agent.localbroker import Broker
from agent.protocol.topics import Topics
from tests.delivery.transfer_rig import KIB, Rig, manifest_for, random_model
from tests.mqtt_probe import Probe, Received
from tests.waiting import wait_until

CHUNK = 4 * KIB


@pytest.fixture
def rig(broker: Broker, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(broker, tmp_path)
    yield r
    r.close()


@pytest.fixture
def probe(broker: Broker) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as p:
        yield p


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return random_model(tmp_path / "repo" / "model.onnx", 5 * CHUNK + 10)


@pytest.fixture
def manifest(model: Path) -> DeployManifest:
    return manifest_for(model, CHUNK)


def ask(
    probe: Probe,
    topics: Topics,
    sha256: str,
    indices: list[int],
    *,
    response_topic: str | None = None,
    chunk_size: int | None = CHUNK,
    device: str | None = None,
) -> bytes:
    """Publish a chunk request as a device would; return its correlation data."""
    correlation = uuid.uuid4().bytes
    body: dict[str, object] = {"sha256": sha256, "indices": indices}
    if chunk_size is not None:
        body["chunk_size"] = chunk_size
    if device is not None:
        body["device"] = device
    probe.publish(
        topics.xfer_req,
        json.dumps(body),
        response_topic=response_topic or topics.xfer(sha256),
        correlation_data=correlation,
    )
    return correlation


def props(message: Received) -> dict[str, str]:
    return dict(message.user_properties)


def test_requested_chunks_come_back_with_index_hash_and_correlation(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = rig.server()
    server.register(manifest, model)
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    correlation = ask(probe, dev, manifest.sha256, [4, 5, 0])
    replies = probe.wait_for_count(dev.xfer(manifest.sha256), 3)

    data = model.read_bytes()
    by_index = {int(props(m)["index"]): m for m in replies}
    assert sorted(by_index) == [0, 4, 5]
    for index, message in by_index.items():
        assert message.payload == data[index * CHUNK : (index + 1) * CHUNK]
        assert props(message)["sha256"] == manifest.chunks[index]
        assert message.correlation_data == correlation
    assert len(by_index[5].payload) == 10  # the short last chunk
    assert server.served_bytes("dev-a") == 2 * CHUNK + 10
    assert server.served_bytes("dev-b") == 0


def test_a_request_for_delivery_to_another_device_is_refused(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = rig.server()
    server.register(manifest, model)
    attacker, victim = Topics(rig.prefix, "dev-a"), Topics(rig.prefix, "dev-b")
    probe.subscribe(f"{rig.prefix}/+/down/xfer/+")

    ask(probe, attacker, manifest.sha256, [0], response_topic=victim.xfer(manifest.sha256))
    ask(probe, attacker, manifest.sha256, [1], device="dev-b")  # claims another device in the body
    wait_until(lambda: server.stats()["refused"] == 2, what="two refusals")
    # The same server handles requests in order: once this answer arrives, nothing else is coming.
    ask(probe, attacker, manifest.sha256, [2])
    probe.wait_for_count(attacker.xfer(manifest.sha256), 1)

    assert [m.topic for m in probe.snapshot()] == [attacker.xfer(manifest.sha256)]
    # Served bytes are counted when the broker acknowledges the chunk, which may follow its delivery.
    wait_until(lambda: server.served_bytes() == CHUNK, what="the served chunk counted")


def test_bad_requests_unknown_models_and_bad_indices_are_counted(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = rig.server()
    server.register(manifest, model)
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    probe.publish(dev.xfer_req, b"{not json", response_topic=dev.xfer(manifest.sha256))
    probe.publish(dev.xfer_req, json.dumps({"sha256": "abc", "indices": [0]}), response_topic=dev.xfer("abc"))
    ask(probe, dev, "f" * 64, [0])
    ask(probe, dev, manifest.sha256, [99, 1, -1])
    probe.wait_for_count(dev.xfer(manifest.sha256), 1)

    # Index -1 comes after the served index 1 in the request: wait for it to be counted too.
    wait_until(lambda: server.stats()["bad_index"] == 2, what="both bad indices counted")
    stats = server.stats()
    assert stats["bad_request"] == 2
    assert stats["unknown_model"] == 1
    assert stats["bad_index"] == 2
    assert [props(m)["index"] for m in probe.snapshot()] == ["1"]


def test_a_repo_directory_serves_files_by_hash_with_the_requested_chunk_size(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    random_model(model.parent / "other.onnx", 1000)
    server = rig.server()
    assert server.add_repo(model.parent) == 2
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    ask(probe, dev, manifest.sha256, [1], chunk_size=2 * CHUNK)
    (reply,) = probe.wait_for_count(dev.xfer(manifest.sha256), 1)

    expected = model.read_bytes()[2 * CHUNK : 4 * CHUNK]
    assert reply.payload == expected
    assert props(reply)["sha256"] == hashlib.sha256(expected).hexdigest()


def test_a_repo_request_without_chunk_size_is_refused(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = rig.server()
    server.add_repo(model.parent)
    dev = Topics(rig.prefix, "dev-a")

    ask(probe, dev, manifest.sha256, [0], chunk_size=None)

    wait_until(lambda: server.stats()["bad_request"] == 1, what="the refusal")
    assert server.served_bytes() == 0


def test_servers_in_one_group_answer_each_request_once(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    servers = [rig.server(), rig.server()]
    for server in servers:
        server.register(manifest, model)
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    for _ in range(10):
        ask(probe, dev, manifest.sha256, [0])
    probe.wait_for_count(dev.xfer(manifest.sha256), 10)
    probe.settle(0.3)

    assert len(probe.snapshot()) == 10
    assert sum(s.stats()["requests"] for s in servers) == 10


def test_register_refuses_a_file_that_is_not_the_manifests(
    rig: Rig, tmp_path: Path, manifest: DeployManifest
) -> None:
    other = random_model(tmp_path / "other.onnx", manifest.size)
    server = rig.server()
    with pytest.raises(ValueError, match="SHA-256"):
        server.register(manifest, other)
