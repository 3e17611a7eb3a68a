"""ChunkServer on a real mosquitto, driven by a plain paho probe playing the device.

The probe (tests/mqtt_probe.py) shares no code with the agent, so a request/response mistake on
either side shows up here.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.protocol.manifest import DeployManifest
from agent.protocol.topics import Topics
from tests.delivery.transfer.transfer_rig import KIB, Rig, manifest_for, random_model
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient, wait_until

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
    timeout_ms: int | None = None,
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
        user_properties=None if timeout_ms is None else [("timeout_ms", str(timeout_ms))],
    )
    return correlation


def props(message: Received) -> dict[str, str]:
    return dict(message.user_properties)


def serving(rig: Rig, manifest: DeployManifest, model: Path) -> ChunkServer:
    """A started server in the rig's group, serving ``model``."""
    server = rig.server()
    server.register(manifest, model)
    return server


def test_requested_chunks_come_back_with_index_hash_and_correlation(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = serving(rig, manifest, model)
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
    # Counted after the publish returns, which may follow the delivery: wait for the count.
    wait_until(lambda: server.served_bytes("dev-a") == 2 * CHUNK + 10, what="the served chunks counted")
    assert server.served_bytes("dev-b") == 0


def test_a_request_for_delivery_to_another_device_is_refused(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = serving(rig, manifest, model)
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
    server = serving(rig, manifest, model)
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


def test_a_model_renamed_into_a_repo_is_served_on_the_first_request_for_it(
    rig: Rig, probe: Probe, tmp_path: Path
) -> None:
    # As the controller's upload lands (temp file + rename) right after the repo was scanned: the
    # first request finds it, rather than a rescan interval and the device's chunk timeout later.
    repo = tmp_path / "uploads"
    random_model(repo / "older.onnx", 1000)
    server = rig.server()
    assert server.add_repo(repo) == 1
    arriving = random_model(tmp_path / "incoming" / "new.onnx", 2 * CHUNK)
    manifest = manifest_for(arriving, CHUNK)
    arriving.rename(repo / "new.onnx")
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    ask(probe, dev, manifest.sha256, [1])
    (reply,) = probe.wait_for_count(dev.xfer(manifest.sha256), 1)

    assert reply.payload == (repo / "new.onnx").read_bytes()[CHUNK:]
    assert server.stats()["unknown_model"] == 0


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
    servers = [serving(rig, manifest, model) for _ in range(2)]
    devices = [Topics(rig.prefix, f"dev-{n}") for n in range(10)]
    probe.subscribe(f"{rig.prefix}/+/down/xfer/+")

    for dev in devices:  # ten devices: a device's repeated request could merge into its first
        ask(probe, dev, manifest.sha256, [0])
    wait_until(lambda: len(probe.snapshot()) >= 10, what="ten replies")
    probe.settle(0.3)

    assert sorted(m.topic for m in probe.snapshot()) == sorted(d.xfer(manifest.sha256) for d in devices)
    assert sum(s.stats()["requests"] for s in servers) == 10


class Gated(ChunkServer):
    """Holds its first chunk until ``gate`` opens: the server is busy with another device meanwhile."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.held = threading.Event()

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        if not self.held.is_set():
            self.held.set()
            assert self.gate.wait(patient(10.0))
        return [(index, data)]


def held_busy(rig: Rig, probe: Probe, manifest: DeployManifest, model: Path, **kwargs: Any) -> Gated:
    """A Gated server serving ``model``, every device's replies watched, its sender held busy with
    dev-busy's chunk 0 (released by ``gate.set()``)."""
    server = cast(Gated, rig.server(Gated, **kwargs))
    server.register(manifest, model)
    probe.subscribe(f"{rig.prefix}/+/down/xfer/+")
    ask(probe, Topics(rig.prefix, "dev-busy"), manifest.sha256, [0])
    assert server.held.wait(patient(5.0))
    return server


def test_asking_again_for_chunks_still_waiting_sends_them_once_in_the_first_requests_place(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    """At fleet scale a device waits in line longer than its chunk timeout and asks again: the
    repeats merge into what waits (its place in line and correlation data are the first request's,
    so its round-trip sample spans the whole wait); nothing is sent twice."""
    server = held_busy(rig, probe, manifest, model)
    dev, late = Topics(rig.prefix, "dev-a"), Topics(rig.prefix, "dev-late")
    first = ask(probe, dev, manifest.sha256, [1, 2])
    ask(probe, late, manifest.sha256, [1])
    ask(probe, dev, manifest.sha256, [2, 3])  # a timeout: 2 again, and 3 for the first time
    ask(probe, dev, manifest.sha256, [1, 2, 3])
    wait_until(lambda: server.stats()["requests"] == 5, what="every request taken in")
    server.gate.set()
    wait_until(lambda: len(probe.snapshot()) >= 5, what="five replies")
    probe.settle(0.3)

    sent = [(m.topic.split("/")[2], int(props(m)["index"])) for m in probe.snapshot()]
    assert sent == [("dev-busy", 0), ("dev-a", 1), ("dev-a", 2), ("dev-a", 3), ("dev-late", 1)]
    assert {m.correlation_data for m in probe.snapshot() if "/dev-a/" in m.topic} == {first}
    assert server.stats()["coalesced"] == 4  # 2 of the third request, 1, 2 and 3 of the fourth
    wait_until(lambda: server.served_bytes("dev-a") == 3 * CHUNK, what="the served chunks counted")


def test_a_request_for_a_chunk_already_sent_is_answered_again(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    """Only what still waits merges: a chunk sent may have been lost; asked for again, it goes again."""
    server = serving(rig, manifest, model)
    dev = Topics(rig.prefix, "dev-a")
    probe.subscribe(dev.xfer_filter)

    ask(probe, dev, manifest.sha256, [0])
    probe.wait_for_count(dev.xfer(manifest.sha256), 1)
    ask(probe, dev, manifest.sha256, [0])
    probe.wait_for_count(dev.xfer(manifest.sha256), 2)

    assert server.stats()["coalesced"] == 0
    wait_until(lambda: server.served_bytes("dev-a") == 2 * CHUNK, what="both chunks counted")


def test_requests_beyond_the_waiting_limit_are_dropped_and_counted(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    server = held_busy(rig, probe, manifest, model, max_waiting=1)
    dev, other = Topics(rig.prefix, "dev-a"), Topics(rig.prefix, "dev-b")
    ask(probe, dev, manifest.sha256, [1])  # waits: the one entry allowed
    ask(probe, other, manifest.sha256, [1])  # no room: dropped, the device will ask again
    ask(probe, dev, manifest.sha256, [2])  # merges into dev-a's entry: no new room needed
    wait_until(lambda: server.stats()["requests"] == 4, what="every request taken in")
    server.gate.set()
    wait_until(lambda: len(probe.snapshot()) >= 3, what="three replies")
    probe.settle(0.3)

    assert [m.topic.split("/")[2] for m in probe.snapshot()] == ["dev-busy", "dev-a", "dev-a"]
    assert server.stats()["busy"] == 1


def test_a_full_line_tells_a_device_that_names_its_timeout_when_to_come_back_and_an_older_one_nothing(
    rig: Rig, probe: Probe, model: Path, manifest: DeployManifest
) -> None:
    """Notices go only to devices that ask for them (user property ``timeout_ms``): an older agent
    would count a reply without an index as malformed."""
    server = held_busy(rig, probe, manifest, model, max_waiting=1)
    ask(probe, Topics(rig.prefix, "dev-a"), manifest.sha256, [1])  # the one entry allowed
    ask(
        probe, Topics(rig.prefix, "dev-old"), manifest.sha256, [1]
    )  # refused: it asks again after its timeout
    newer = ask(probe, Topics(rig.prefix, "dev-new"), manifest.sha256, [1], timeout_ms=5000)
    wait_until(lambda: server.stats()["busy"] == 2, what="both refused")
    probe.wait_for_count(Topics(rig.prefix, "dev-new").xfer(manifest.sha256), 1)
    server.gate.set()
    wait_until(lambda: len(probe.snapshot()) >= 3, what="the notice and two chunks")
    probe.settle(0.3)

    [notice] = [m for m in probe.snapshot() if "/dev-new/" in m.topic]
    assert (notice.payload, notice.correlation_data) == (b"", newer)
    assert props(notice) == {"retry_ms": "5000"}  # no rate measured yet: the default
    assert not [m for m in probe.snapshot() if "/dev-old/" in m.topic]
    assert server.stats()["busy_notices"] == 1


def test_register_refuses_a_file_that_is_not_the_manifests(
    rig: Rig, tmp_path: Path, manifest: DeployManifest
) -> None:
    other = random_model(tmp_path / "other.onnx", manifest.size)
    server = rig.server()
    with pytest.raises(ValueError, match="SHA-256"):
        server.register(manifest, other)
