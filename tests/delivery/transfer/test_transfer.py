"""The MQTT chunk pull against a real mosquitto, a real MqttLink and a real ChunkServer.

Fault injection uses ChunkServer subclasses that override its ``replies`` seam: real servers that
corrupt, drop, duplicate or mis-number chunk replies on the wire.
"""

from __future__ import annotations

import collections
import http.server
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.delivery.transfer.partial import PartialDownload
from agent.delivery.transfer.pull import MqttPull, PullStats, fetch_model
from agent.delivery.transfer.replies import router_for
from agent.fleet.chunks.server import ChunkServer
from agent.protocol.delivery_errors import HashMismatchError, JobCancelledError, TransferTimeoutError
from agent.protocol.manifest import DeployManifest, ModelSourceRef
from agent.store import ModelStore
from tests.delivery.transfer.transfer_rig import (
    KIB,
    MIB,
    Device,
    Rig,
    Slow,
    delivery_config,
    manifest_for,
    random_model,
)
from tests.waiting import patient, wait_until

CHUNK = 64 * KIB


def pull(
    dev: Device,
    manifest: DeployManifest,
    cancel: threading.Event | None = None,
    **config: float,
) -> tuple[PullStats, Path]:
    """Run one MqttPull to completion, set up like fetch_model; return its stats and the verified file."""
    window = int(config.get("chunk_window", 4))
    partial = PartialDownload(dev.part_dir, manifest, flush_every=max(1, window // 2), background=True)
    puller = MqttPull(
        manifest, partial, link=dev.link, topics=dev.topics, config=delivery_config(**config), cancel=cancel
    )
    try:
        puller.run()
        return puller.stats, partial.finish()
    finally:
        partial.close()


# -- fault-injecting servers (real servers, wrong replies) ----------------------------------------


class CorruptsOnce(ChunkServer):
    """Flips one byte of chunk 3 the first time it is asked for."""

    corrupted = False

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        if index == 3 and not self.corrupted:
            self.corrupted = True
            return [(index, bytes([data[0] ^ 0xFF]) + data[1:])]
        return [(index, data)]


class AnswersOutOfRange(ChunkServer):
    """Every reply is followed by one for an index far past the end of the model."""

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        return [(index, data), (10_000 + index, data)]


class Duplicates(ChunkServer):
    """Sends every chunk twice."""

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        return [(index, data), (index, data)]


class SilentOnce(ChunkServer):
    """Ignores the first request for chunk 2."""

    ignored = False

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        if index == 2 and not self.ignored:
            self.ignored = True
            return []
        return [(index, data)]


class NeverAnswers2(ChunkServer):
    """Never answers chunk 2; counts how often it was asked for each chunk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: collections.Counter[int] = collections.Counter()

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        self.asked[index] += 1
        return [] if index == 2 else [(index, data)]


class Slower(Slow):
    """Takes 150 ms per chunk: longer than the device's configured chunk timeout in the test below."""

    delay_s = 0.15


# -- tests ------------------------------------------------------------------------------------------


def test_fetch_model_transfers_a_random_file_exactly(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "src" / "model.bin", 3 * MIB + 12345)  # short last chunk
    manifest = manifest_for(model, CHUNK)
    server = rig.server()
    server.register(manifest, model)
    dev = rig.device()
    progress: list[tuple[int, int]] = []

    path = fetch_model(
        manifest,
        dev.part_dir,
        lambda done, total: progress.append((done, total)),
        threading.Event(),
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(),
    )

    assert path.read_bytes() == model.read_bytes()
    assert path == dev.part_dir / f"{manifest.sha256}.verified"
    assert not (dev.part_dir / f"{manifest.sha256}.part").exists()
    assert not (dev.part_dir / f"{manifest.sha256}.bitmap").exists()
    done = [d for d, _ in progress]
    assert done == sorted(done)
    assert progress[-1] == (manifest.size, manifest.size)
    # A clean transfer asks for every chunk once: nothing served twice.
    assert server.served_bytes(dev.id) == manifest.size
    assert server.served_bytes(dev.id, manifest.sha256) == manifest.size


def test_a_manifest_whose_whole_hash_contradicts_its_chunks_is_refused_where_the_file_is_adopted(
    rig: Rig,
) -> None:
    """The pull checks every chunk and leaves the whole file's hash to the store, once: a signed
    manifest whose chunks are one file's and whose SHA-256 another's gets through the pull (every chunk
    matches) and is refused, its file removed, when the job moves it into the store."""
    model = random_model(rig.tmp_path / "m.bin", 6 * CHUNK)
    lying = manifest_for(model, CHUNK).model_copy(update={"sha256": "0" * 64})
    rig.server().register(lying, model, verify=False)
    dev = rig.device()
    path = fetch_model(
        lying,
        dev.part_dir,
        lambda done, total: None,
        threading.Event(),
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(),
    )
    assert path.read_bytes() == model.read_bytes()

    with pytest.raises(HashMismatchError):
        ModelStore(rig.tmp_path / "models").adopt(path, lying.sha256)
    assert not path.exists()
    assert not (rig.tmp_path / "models" / f"{lying.sha256}.onnx").exists()


def test_a_corrupted_chunk_is_dropped_and_fetched_again(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 10 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server = rig.server(CorruptsOnce)
    server.register(manifest, model)

    stats, path = pull(rig.device(), manifest)

    assert path.read_bytes() == model.read_bytes()
    assert stats.corrupt == 1
    assert stats.written == manifest.chunk_count
    assert stats.requested_chunks == manifest.chunk_count + 1  # chunk 3 asked for twice


def test_out_of_range_replies_are_counted_and_ignored(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 6 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    rig.server(AnswersOutOfRange).register(manifest, model)

    stats, path = pull(rig.device(), manifest)

    assert path.read_bytes() == model.read_bytes()
    assert stats.out_of_range >= 1
    assert stats.corrupt == 0


def test_duplicate_replies_are_counted_and_dropped(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 6 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    rig.server(Duplicates).register(manifest, model)

    stats, path = pull(rig.device(), manifest)

    assert path.read_bytes() == model.read_bytes()
    assert stats.duplicate >= 1
    assert stats.written == manifest.chunk_count


def test_an_unanswered_chunk_is_requested_again_after_its_timeout(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 6 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    rig.server(SilentOnce).register(manifest, model)

    stats, path = pull(rig.device(), manifest, chunk_timeout_s=0.3)

    assert path.read_bytes() == model.read_bytes()
    assert stats.timeouts == 1
    assert stats.refetched_bytes == CHUNK


def test_chunks_never_answered_fail_at_the_deadline_and_a_new_attempt_resumes(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 6 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    bad = rig.server(NeverAnswers2)
    bad.register(manifest, model)
    dev = rig.device()

    with pytest.raises(TransferTimeoutError) as caught:
        pull(dev, manifest, chunk_timeout_s=0.2, job_deadline_s=1.5)

    assert caught.value.code == "transfer_timeout"
    assert "1 of 6 chunks still missing" in str(caught.value)
    with PartialDownload(dev.part_dir, manifest) as partial:
        assert partial.missing() == [2]  # everything else was kept on disk
    # Retryable: with a working server the next attempt fetches only the missing chunk.
    bad.stop()
    good = rig.server(ChunkServer)
    good.register(manifest, model)
    stats, path = pull(dev, manifest)
    assert path.read_bytes() == model.read_bytes()
    assert stats.requested_chunks == 1
    assert good.served_bytes(dev.id) == CHUNK


def test_timeouts_back_off_exponentially(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 3 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server = rig.server(NeverAnswers2)
    assert isinstance(server, NeverAnswers2)
    server.register(manifest, model)

    with pytest.raises(TransferTimeoutError):
        pull(rig.device(), manifest, chunk_timeout_s=0.1, job_deadline_s=1.4)

    # Asked at 0, 0.1, 0.3, 0.7 s (waits double: 0.1, 0.2, 0.4, 0.8): 4 requests before the
    # deadline; a flat 0.1 s timeout would have asked about 14 times. A loaded machine only
    # makes the count smaller.
    assert 2 <= server.asked[2] <= 4
    assert server.asked[0] == 1


def test_cancel_stops_the_pull_and_keeps_what_arrived(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 40 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    rig.server(Slow).register(manifest, model)
    dev = rig.device()
    cancel = threading.Event()
    partial = PartialDownload(dev.part_dir, manifest, flush_every=2, background=True)
    puller = MqttPull(
        manifest, partial, link=dev.link, topics=dev.topics, config=delivery_config(), cancel=cancel
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            puller.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: puller.stats.written >= 3, what="a few chunks")
    cancel.set()
    thread.join(patient(5.0))

    assert not thread.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], JobCancelledError)
    assert errors[0].code == "cancelled"
    written = puller.stats.written
    partial.close()
    with PartialDownload(dev.part_dir, manifest) as again:
        assert manifest.chunk_count - len(again.missing()) == written  # flushed on the way out


def test_requests_go_on_while_a_slow_disk_flushes_and_stay_within_the_window(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fdatasync

    def slow_fdatasync(fd: Any) -> None:  # the real sync, then 100 ms more: an SD card's latency
        real(fd)
        time.sleep(0.1)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    model = random_model(rig.tmp_path / "m.bin", 16 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server = rig.server()
    server.register(manifest, model)
    dev = rig.device()

    stats, path = pull(dev, manifest, chunk_window=4)

    assert path.read_bytes() == model.read_bytes()
    # Half a window is flushed while the other half is requested and received ...
    assert stats.requested_while_flushing > 0
    # ... and what a crash could cost never exceeds the window.
    assert 0 < stats.max_at_risk <= 4
    assert server.served_bytes(dev.id) == manifest.size
    # The flushes' time is counted: at least one batch paid for its two slow syncs.
    assert stats.flush_ms >= 200


def test_two_devices_pull_at_once_from_two_servers_sharing_the_requests(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 2 * MIB)
    manifest = manifest_for(model, CHUNK)
    servers = [rig.server(), rig.server()]
    for server in servers:
        server.register(manifest, model)
    devices = [rig.device(), rig.device()]
    results: dict[str, bytes] = {}

    def run(dev: Device) -> None:
        _, path = pull(dev, manifest)
        results[dev.id] = path.read_bytes()

    threads = [threading.Thread(target=run, args=(dev,)) for dev in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(patient(60.0))

    assert set(results) == {d.id for d in devices}
    assert all(data == model.read_bytes() for data in results.values())
    for dev in devices:
        served = sum(s.served_bytes(dev.id) for s in servers)
        # A shared subscription gives each request to ONE server; two plain subscribers would
        # both answer and serve every byte twice.
        assert manifest.size <= served < 1.5 * manifest.size


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_fetch_model_falls_through_a_failing_http_source_to_mqtt(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 5 * CHUNK)
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=http_server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{http_server.server_address[1]}/model.bin"
    sources = [ModelSourceRef(kind="http", url=url), ModelSourceRef(kind="mqtt")]
    manifest = manifest_for(model, CHUNK, sources=sources)
    server = rig.server()
    server.register(manifest, model)
    dev = rig.device()

    path = fetch_model(
        manifest,
        dev.part_dir,
        lambda done, total: None,
        threading.Event(),
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(http_timeout_s=1.0),
    )

    http_server.shutdown()
    http_server.server_close()
    assert path.read_bytes() == model.read_bytes()
    assert server.served_bytes(dev.id) == manifest.size


def test_chunks_still_arriving_restart_the_timeout_of_the_rest(rig: Rig) -> None:
    """A server sending a window's chunks 50 ms apart takes 1.2 s for 24 of them; the timeout is held
    at 0.5 s (no learning). Each arrival restarts the timer of what is still outstanding (RFC 6298
    5.3), so nothing is asked for again while the replies keep coming."""
    model = random_model(rig.tmp_path / "m.bin", 24 * CHUNK)
    manifest = manifest_for(model, CHUNK)
    server = rig.server(Slow)
    server.register(manifest, model)
    dev = rig.device()
    partial = PartialDownload(dev.part_dir, manifest, flush_every=24, background=True)
    config = delivery_config(chunk_window=24, chunk_timeout_s=0.5)
    puller = MqttPull(manifest, partial, link=dev.link, topics=dev.topics, config=config)
    puller.timer.ceiling_s = puller.timer.floor_s
    try:
        puller.run()
        assert partial.finish().read_bytes() == model.read_bytes()
    finally:
        partial.close()
    assert puller.stats.requests == 1
    assert puller.stats.timeouts == 0
    assert puller.stats.refetched_bytes == 0
    assert server.served_bytes() == manifest.size


def test_slow_answers_raise_the_timeout_instead_of_asking_again(rig: Rig) -> None:
    """A server that answers every chunk slowly (150 ms each, one at a time) against a configured
    timeout of 0.1 s: held there, a chunk times out between any two replies and is asked for again
    while still on its way (arrivals restart the timer, but not for long enough). The timer learns the
    round trips and waits longer; run with the timer held at the floor, for comparison. The server
    sends no notices (``pace=False``): they would spare both runs their repeats, and this is the
    timer's test (tests/delivery/transfer/test_pacing.py is the notices')."""
    model = random_model(rig.tmp_path / "m.bin", 12 * CHUNK)
    manifest = manifest_for(model, CHUNK)

    def run(*, adaptive: bool) -> PullStats:
        server = rig.server(Slower, pace=False)  # one per run: no backlog of the other run's requests
        server.register(manifest, model)
        dev = rig.device()
        partial = PartialDownload(dev.part_dir, manifest, flush_every=4, background=True)
        config = delivery_config(chunk_window=8, chunk_timeout_s=0.1)
        puller = MqttPull(manifest, partial, link=dev.link, topics=dev.topics, config=config)
        if not adaptive:
            puller.timer.ceiling_s = puller.timer.floor_s  # a fixed timeout, as before the timer
        try:
            puller.run()
            assert partial.finish().read_bytes() == model.read_bytes()
        finally:
            partial.close()
            server.stop()
        return puller.stats

    fixed = run(adaptive=False)
    learned = run(adaptive=True)
    assert learned.timeout_ms > 150
    assert learned.refetched_bytes * 2 < fixed.refetched_bytes, (learned, fixed)


def test_replies_taken_in_one_go_are_reported_one_by_one(rig: Rig) -> None:
    """A busy device takes queued replies in one go; its progress still steps chunk by chunk, so a
    job's first tenth is where the download started (``fleet deploy``'s rate-cap check reads it)
    and not, as it was, the whole file at once."""
    model = random_model(rig.tmp_path / "m.bin", 16 * KIB)
    manifest = manifest_for(model, KIB)
    rig.server().register(manifest, model)
    dev = rig.device()
    done: list[int] = []

    def progress(bytes_done: int, _total: int) -> None:
        if bytes_done and not done:
            # Hold the pull thread until the rest of the window's replies wait in its queue.
            route = router_for(dev.link, dev.topics)._routes[manifest.sha256]
            wait_until(lambda: route.qsize() >= 3, timeout=30, what="three more replies queued")
        done.append(bytes_done)

    fetch_model(
        manifest, dev.part_dir, progress, threading.Event(),
        link=dev.link, topics=dev.topics, config=delivery_config(chunk_window=4),
    )  # fmt: skip

    assert done[-1] == manifest.size
    steps = [b - a for a, b in itertools.pairwise([0, *done])]
    assert max(steps) == KIB, done


def test_a_pull_that_gets_no_chunk_for_its_stall_time_ends_long_before_its_deadline(rig: Rig) -> None:
    """A fleet engine the controller no longer holds (evicted or withdrawn after it answered the
    ask): no server answers, and the pull ends after ``stall_s`` instead of the job's deadline."""
    model = random_model(rig.tmp_path / "m.bin", 4 * KIB)
    manifest = manifest_for(model, KIB)
    rig.server()  # serves, but not this model
    dev = rig.device()
    cancel = threading.Event()
    timer = threading.Timer(patient(60.0), cancel.set)  # the deadline's stand-in: a cancel, not a pass
    timer.start()
    try:
        with pytest.raises(TransferTimeoutError) as caught:
            fetch_model(
                manifest, dev.part_dir, lambda _d, _t: None, cancel,
                link=dev.link, topics=dev.topics, config=delivery_config(job_deadline_s=3600.0), stall_s=1.0,
            )  # fmt: skip
    finally:
        timer.cancel()
    assert "no chunk arrived in 1s (4 of 4 missing)" in str(caught.value)


def test_a_slow_server_that_keeps_sending_is_not_a_stall(rig: Rig) -> None:
    """Each chunk restarts the stall clock: a server slower per chunk than nothing at all finishes."""
    model = random_model(rig.tmp_path / "m.bin", 16 * KIB)  # 16 chunks of 150 ms: 2.4 s in all
    manifest = manifest_for(model, KIB)
    rig.server(Slower).register(manifest, model)
    dev = rig.device()
    path = fetch_model(
        manifest, dev.part_dir, lambda _d, _t: None, threading.Event(),
        link=dev.link, topics=dev.topics, config=delivery_config(chunk_window=1), stall_s=patient(1.5),
    )  # fmt: skip
    assert path.read_bytes() == model.read_bytes()
