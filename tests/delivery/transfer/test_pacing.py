"""A pull paced by the server (docs/delivery.md, "Pacing"), against a real mosquitto and ChunkServer:
a long line makes the device wait instead of asking again, a full one makes it hold its requests.
The engine download takes the same path (fetch_engine_file through fetch_model)."""

from __future__ import annotations

import functools
import hashlib
import threading
import time

from agent.delivery.transfer.engine_fetch import fetch_engine_file
from agent.delivery.transfer.partial import PartialDownload
from agent.delivery.transfer.pull import MqttPull, PullStats, fetch_model
from agent.fleet.chunks.server import ChunkServer
from agent.protocol.delivery_errors import TransferTimeoutError
from agent.protocol.engines import EngineFile
from agent.protocol.manifest import DeployManifest
from tests.delivery.transfer.transfer_rig import (
    KIB,
    Device,
    Rig,
    Slow,
    delivery_config,
    manifest_for,
    random_model,
)
from tests.waiting import patient, wait_until

CHUNK = 4 * KIB
#: The device's timeout floor: far shorter than the line it meets, so without the server's word it
#: would ask again several times before its chunks leave.
TIMEOUT_S = 0.2


class Paced(Slow):
    """Takes 20 ms per chunk (a server busy with a whole fleet, scaled down)."""

    delay_s = 0.02


def pull(dev: Device, manifest: DeployManifest, deadline_s: float | None = None) -> PullStats:
    """One pull's counters, whether it completed or ran into ``deadline_s`` (TransferTimeoutError)."""
    partial = PartialDownload(dev.part_dir, manifest, flush_every=2, background=True)
    puller = MqttPull(
        manifest,
        partial,
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(chunk_timeout_s=TIMEOUT_S),
        deadline=None if deadline_s is None else time.monotonic() + deadline_s,
    )
    try:
        puller.run()
        partial.finish()
    except TransferTimeoutError:
        assert deadline_s is not None
    finally:
        partial.close()
    return puller.stats


def line_ahead(rig: Rig, server: ChunkServer) -> threading.Thread:
    """Another device asking for a 120-chunk model at once, its chunks leaving one every 20 ms; returns
    once the server has served long enough to know its rate (its pull goes on in the thread)."""
    model = random_model(rig.tmp_path / "ahead.bin", 120 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server.register(manifest, model)
    dev = rig.device("dev-ahead")
    config = delivery_config(chunk_window=128, chunk_timeout_s=30.0)
    fetch = functools.partial(fetch_model, link=dev.link, topics=dev.topics, config=config)
    thread = threading.Thread(
        target=fetch, args=(manifest, dev.part_dir, lambda d, t: None, threading.Event()), daemon=True
    )
    thread.start()
    wait_until(lambda: server.served_bytes("dev-ahead") >= 40 * CHUNK, what="the line's rate measured")
    return thread


def test_a_pull_behind_a_long_line_waits_as_told_instead_of_asking_again(rig: Rig) -> None:
    server = rig.server(Paced)
    model = random_model(rig.tmp_path / "m.bin", 4 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server.register(manifest, model)
    ahead = line_ahead(rig, server)

    stats = pull(rig.device(), manifest)

    assert stats.timeouts == 0, stats
    assert stats.requested_chunks == manifest.chunk_count  # each chunk asked for once
    assert stats.wait_notices >= 1
    assert stats.server_wait_ms > TIMEOUT_S * 1000
    assert server.stats()["wait_notices"] >= 1
    ahead.join(patient(30.0))


def test_an_engine_download_behind_a_long_line_waits_too(rig: Rig) -> None:
    """The engine download is the same pull (fetch_engine_file through fetch_model)."""
    server = rig.server(Paced)
    data = random_model(rig.tmp_path / "engine.plan", 4 * CHUNK).read_bytes()
    file = EngineFile(
        name="engine.plan",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        chunk_size=CHUNK,
        chunks=[hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)],
    )
    server.add_repo(rig.tmp_path)  # as the controller serves its engine store: by SHA-256
    ahead = line_ahead(rig, server)
    dev = rig.device()
    pulls: list[PullStats] = []
    fetch = functools.partial(
        fetch_model,
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(chunk_timeout_s=TIMEOUT_S),
        on_pull=pulls.append,
    )

    path = fetch_engine_file(file, dev.part_dir, None, fetch=fetch)

    assert path.read_bytes() == data
    assert pulls[0].timeouts == 0, pulls[0]
    assert pulls[0].wait_notices >= 1
    ahead.join(patient(30.0))


def test_a_pull_that_meets_a_full_line_backs_off_instead_of_asking_again(rig: Rig) -> None:
    """A server with no room (max_waiting 0: every request is refused busy) answers with a busy
    notice; the device holds its requests for the time named (5 s without a measured rate), so in
    2 s it asked once. Without the notice, its 0.2 s timeout, doubling, asks four times."""
    server = rig.server(max_waiting=0)
    model = random_model(rig.tmp_path / "m.bin", 4 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server.register(manifest, model)
    dev = rig.device()

    stats = pull(dev, manifest, deadline_s=2.0)

    assert stats.written == 0  # the deadline ended it
    assert (stats.requests, stats.busy_notices, stats.timeouts) == (1, 1, 0), stats
    assert server.stats()["requests"] == 1
    assert server.stats()["busy"] == server.stats()["busy_notices"] == 1
