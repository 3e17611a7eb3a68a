"""PartialDownload: verified chunk writes, the persisted bitmap, resume, start-over and the final check."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from agent import fsutil
from agent.delivery.transfer import flusher
from agent.delivery.transfer.chunk_log import (
    RECORD,
    ChunkLog,
    decode_records,
    encode_records,
    log_key,
    read_log,
)
from agent.delivery.transfer.flusher import read_record
from agent.delivery.transfer.partial import PartialDownload
from agent.errors import DeliveryError
from agent.protocol.delivery_errors import HashMismatchError
from agent.protocol.manifest import DeployManifest
from tests.delivery.transfer.transfer_rig import KIB, manifest_for, random_model
from tests.page_cache import resident_bytes
from tests.waiting import patient, wait_until

CHUNK = 4 * KIB


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return random_model(tmp_path / "src" / "model.bin", 10 * CHUNK + 100)  # 11 chunks, the last short


@pytest.fixture
def manifest(model: Path) -> DeployManifest:
    return manifest_for(model, CHUNK)


def chunk(model: Path, index: int) -> bytes:
    return model.read_bytes()[index * CHUNK : (index + 1) * CHUNK]


def test_a_new_download_is_preallocated_and_everything_is_missing(
    tmp_path: Path, manifest: DeployManifest
) -> None:
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        assert partial.missing() == list(range(11))
        assert partial.part_path.stat().st_size == manifest.size
        assert partial.bitmap_path.exists()
        assert not partial.complete
        assert partial.bytes_done == 0


def test_all_chunks_in_any_order_finish_into_the_verified_file(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    partial = PartialDownload(tmp_path / "partial", manifest)
    for index in reversed(range(11)):
        assert partial.write_chunk(index, chunk(model, index))
    assert partial.complete
    assert partial.bytes_done == manifest.size

    path = partial.finish()

    assert path == tmp_path / "partial" / f"{manifest.sha256}.verified"
    assert path.read_bytes() == model.read_bytes()
    assert not partial.part_path.exists()
    assert not partial.bitmap_path.exists()


@pytest.mark.parametrize(
    ("index", "data_index", "trim", "kind"),
    [
        (3, 4, 0, "bad_hash"),  # another chunk's bytes
        (3, 3, 1, "bad_length"),  # one byte short
        (11, 10, 0, "out_of_range"),
        (-1, 0, 0, "out_of_range"),
    ],
)
def test_a_wrong_chunk_is_refused_counted_and_never_written(
    tmp_path: Path, model: Path, manifest: DeployManifest, index: int, data_index: int, trim: int, kind: str
) -> None:
    data = chunk(model, data_index)
    data = data[: len(data) - trim]
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        assert not partial.write_chunk(index, data)
        assert partial.rejected[kind] == 1
        assert partial.missing() == list(range(11))
        assert partial.part_path.read_bytes() == b"\0" * manifest.size


def test_a_duplicate_chunk_is_refused(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        assert partial.write_chunk(2, chunk(model, 2))
        assert not partial.write_chunk(2, chunk(model, 2))
        assert partial.rejected["duplicate"] == 1


def test_reopening_resumes_from_the_bitmap(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    part_dir = tmp_path / "partial"
    first = PartialDownload(part_dir, manifest)  # flush_every=1: every chunk is durable at once
    for index in (0, 1, 5):
        first.write_chunk(index, chunk(model, index))
    first.close()  # like a crash: nothing else is done

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing() == [2, 3, 4, 6, 7, 8, 9, 10]
        assert again.bytes_done == 3 * CHUNK
        for index in again.missing():
            assert again.write_chunk(index, chunk(model, index))
        assert again.finish().read_bytes() == model.read_bytes()


def test_unflushed_chunks_are_lost_by_a_crash_and_flushed_ones_kept(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    part_dir = tmp_path / "partial"
    first = PartialDownload(part_dir, manifest, flush_every=3)
    for index in range(5):  # chunks 0-2 flushed by the third write; 3 and 4 pending
        first.write_chunk(index, chunk(model, index))
    assert first.unflushed == 2
    first.close()

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing()[:1] == [3]
        assert len(again.missing()) == 8


def test_explicit_flush_records_pending_chunks(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    part_dir = tmp_path / "partial"
    first = PartialDownload(part_dir, manifest, flush_every=100)
    first.write_chunk(7, chunk(model, 7))
    first.flush()
    first.close()
    with PartialDownload(part_dir, manifest) as again:
        assert 7 not in again.missing()


def test_a_bitmap_for_another_chunk_layout_starts_over(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    part_dir = tmp_path / "partial"
    with PartialDownload(part_dir, manifest) as first:
        first.write_chunk(0, chunk(model, 0))
    other = manifest_for(model, 2 * CHUNK)  # same file, same SHA-256, other chunking

    with PartialDownload(part_dir, other) as again:
        assert again.missing() == list(range(other.chunk_count))
        assert again.part_path.read_bytes() == b"\0" * manifest.size


@pytest.mark.parametrize("garbage", [b"", b"{not json", b"[1, 2]", b'{"version": 1}'])
def test_an_unreadable_bitmap_starts_over(
    tmp_path: Path, model: Path, manifest: DeployManifest, garbage: bytes
) -> None:
    part_dir = tmp_path / "partial"
    with PartialDownload(part_dir, manifest) as first:
        first.write_chunk(0, chunk(model, 0))
        bitmap = first.bitmap_path
    bitmap.write_bytes(garbage)

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing() == list(range(11))
    assert json.loads(bitmap.read_text())["sha256"] == manifest.sha256  # rewritten


def test_a_truncated_part_file_starts_over(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    part_dir = tmp_path / "partial"
    with PartialDownload(part_dir, manifest) as first:
        first.write_chunk(0, chunk(model, 0))
        part = first.part_path
    with part.open("r+b") as f:
        f.truncate(100)

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing() == list(range(11))
        assert again.part_path.stat().st_size == manifest.size


def test_a_chunk_damaged_on_disk_is_fetched_again(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    part_dir = tmp_path / "partial"
    with PartialDownload(part_dir, manifest) as first:
        for index in (0, 1, 2):
            first.write_chunk(index, chunk(model, index))
        part = first.part_path
    with part.open("r+b") as f:
        f.seek(CHUNK + 10)
        f.write(b"\xff\xfe")

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing()[:1] == [1]
        assert not again.has(1)
        assert again.has(0)
        assert again.has(2)


def test_a_manifest_whose_whole_hash_is_wrong_fails_and_removes_the_files(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    lying = manifest.model_copy(update={"sha256": "0" * 64})
    partial = PartialDownload(tmp_path / "partial", lying)
    for index in range(11):
        partial.write_chunk(index, chunk(model, index))

    with pytest.raises(HashMismatchError) as caught:
        partial.finish()

    assert caught.value.code == "hash_mismatch"
    assert not partial.part_path.exists()
    assert not partial.bitmap_path.exists()
    assert not partial.verified_path.exists()


def test_finish_refuses_an_incomplete_download(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        partial.write_chunk(0, chunk(model, 0))
        with pytest.raises(DeliveryError, match="10 of 11 chunks missing"):
            partial.finish()


def test_a_finished_download_reopens_complete(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    part_dir = tmp_path / "partial"
    first = PartialDownload(part_dir, manifest)
    for index in range(11):
        first.write_chunk(index, chunk(model, index))
    first.finish()

    again = PartialDownload(part_dir, manifest)
    assert again.complete
    assert again.missing() == []
    assert again.finish().read_bytes() == model.read_bytes()


# -- background flushing ----------------------------------------------------------------------------


def _recorded_chunks(partial: PartialDownload) -> set[int]:
    """The chunks the record on disk names: the bitmap's, plus the log's."""
    have = read_record(partial.bitmap_path, partial.log_path, partial.manifest)
    assert have is not None
    return {i for i, bit in enumerate(have) if bit}


class _SyncGate:
    """Wraps the real ``os.fdatasync``, bitmap write and log append: records their order, can hold a sync.

    ``synced``: chunks written before a sync of the ``.part`` that has completed (so their data is
    on disk); ``records``: for every bitmap written or log append, the chunks it names and what was
    ``synced`` then.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written: set[int] = set()
        self.synced: set[int] = set()
        self.records: list[tuple[set[int], set[int]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail: OSError | None = None
        real = os.fdatasync
        real_pwrite = os.pwrite

        def pwrite(fd: int, data: Any, offset: int) -> int:
            written = real_pwrite(fd, data, offset)
            if written == len(data):  # chunks go down in one call (else the loop would go on)
                self.written.add(offset // CHUNK)
            return written

        def fdatasync(fd: Any) -> None:
            began = set(self.written)
            self.entered.set()
            assert self.release.wait(patient(10)), "test never released the sync"
            if self.fail is not None:
                raise self.fail
            real(fd)
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
                self.synced |= began

        def atomic_write_json(path: Path, obj: Any, **kwargs: Any) -> None:
            bits = bytes.fromhex(obj["done"])
            named = {i for i in range(len(bits) * 8) if bits[i >> 3] >> (i & 7) & 1}
            self.records.append((named, set(self.synced)))
            fsutil.atomic_write_json(path, obj, **kwargs)

        real_append = ChunkLog.append

        def append(log: ChunkLog, indexes: Iterable[int]) -> None:
            self.records.append((set(indexes), set(self.synced)))
            real_append(log, indexes)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(flusher, "atomic_write_json", atomic_write_json)
        monkeypatch.setattr(ChunkLog, "append", append)

    def write(self, partial: PartialDownload, model: Path, index: int) -> None:
        assert partial.write_chunk(index, chunk(model, index))


def test_a_background_flush_records_only_chunks_whose_data_was_synced_first(
    tmp_path: Path, model: Path, manifest: DeployManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _SyncGate(monkeypatch)
    part_dir = tmp_path / "partial"
    partial = PartialDownload(part_dir, manifest, flush_every=2, background=True)
    gate.release.clear()
    gate.write(partial, model, 0)
    gate.write(partial, model, 1)  # the batch [0, 1] is due: the flusher takes it and syncs
    assert gate.entered.wait(patient(5))
    for index in (2, 3, 4):  # written while the sync of [0, 1] is held
        gate.write(partial, model, index)
    assert partial.unflushed == 5
    assert partial.flushing
    assert _recorded_chunks(partial) == set()  # nothing durable yet

    gate.release.set()
    wait_until(lambda: partial.unflushed == 0, what="both batches durable")

    # [2, 3, 4] went in a second batch with a sync of its own: each record names only chunks
    # written before a sync of the data that completed before the record was written.
    named = [record for record, _ in gate.records]
    assert named[-2:] == [{0, 1}, {2, 3, 4}]
    for record, synced in gate.records:
        assert record <= synced
    assert _recorded_chunks(partial) == {0, 1, 2, 3, 4}
    partial.close()
    with PartialDownload(part_dir, manifest) as again:
        assert again.missing() == [5, 6, 7, 8, 9, 10]


def test_chunks_written_during_a_flush_are_lost_by_a_crash_and_the_flushed_ones_kept(
    tmp_path: Path, model: Path, manifest: DeployManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _SyncGate(monkeypatch)
    part_dir = tmp_path / "partial"
    partial = PartialDownload(part_dir, manifest, flush_every=3, background=True)
    gate.release.clear()
    for index in range(3):
        gate.write(partial, model, index)
    assert gate.entered.wait(patient(5))
    gate.write(partial, model, 3)  # not part of the running flush
    gate.release.set()
    partial.close()  # waits for the running flush only; like a crash for chunk 3

    with PartialDownload(part_dir, manifest) as again:
        assert again.missing() == [3, 4, 5, 6, 7, 8, 9, 10]


def test_a_failed_background_flush_is_raised_to_the_owner_and_records_nothing(
    tmp_path: Path, model: Path, manifest: DeployManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _SyncGate(monkeypatch)
    part_dir = tmp_path / "partial"
    partial = PartialDownload(part_dir, manifest, flush_every=2, background=True)
    gate.fail = OSError(errno.EIO, "Input/output error")
    gate.write(partial, model, 0)
    gate.write(partial, model, 1)
    wait_until(gate.entered.is_set, what="the flush to start")

    with pytest.raises(OSError, match="Input/output"):
        wait_until_raises(lambda: partial.write_chunk(2, chunk(model, 2)))
    with pytest.raises(OSError):
        partial.flush()
    assert partial.unflushed >= 2  # still at risk: never recorded
    partial.close()
    gate.fail = None
    with PartialDownload(part_dir, manifest) as again:
        assert again.missing()[:2] == [0, 1]


def wait_until_raises(action: Callable[[], object], timeout: float = 5.0) -> None:
    """Call ``action`` until it raises (the exception propagates); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        action()
        time.sleep(0.01)
    raise AssertionError(f"no exception within {timeout}s")


def test_request_flush_makes_a_partial_batch_durable_and_tells_the_owner(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    told = threading.Event()
    partial = PartialDownload(
        tmp_path / "partial", manifest, flush_every=100, background=True, on_durable=told.set
    )
    partial.write_chunk(4, chunk(model, 4))
    assert partial.unflushed == 1

    partial.request_flush()

    assert told.wait(patient(5))
    assert partial.unflushed == 0
    assert _recorded_chunks(partial) == {4}
    partial.close()


def test_a_failed_flush_keeps_its_chunks_pending_for_the_next_one(
    tmp_path: Path, model: Path, manifest: DeployManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _SyncGate(monkeypatch)
    partial = PartialDownload(tmp_path / "partial", manifest, flush_every=100)
    gate.write(partial, model, 6)
    gate.fail = OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError):
        partial.flush()

    assert partial.unflushed == 1
    assert _recorded_chunks(partial) == set()
    gate.fail = None
    partial.flush()
    assert partial.unflushed == 0
    assert _recorded_chunks(partial) == {6}
    partial.close()


# -- the log's torn or garbled tail -----------------------------------------------------------------


def _logged_download(part_dir: Path, model: Path, manifest: DeployManifest, indexes: list[int]) -> Path:
    """Write and flush ``indexes`` one flush each (one log record each); return the log's path."""
    with PartialDownload(part_dir, manifest) as partial:
        for index in indexes:
            assert partial.write_chunk(index, chunk(model, index))
        assert read_log(partial.log_path, manifest) == indexes  # appended, not in a new bitmap
        return partial.log_path


@pytest.mark.parametrize("cut", [1, 4, 7])
def test_a_torn_last_record_loses_only_its_own_chunk(
    tmp_path: Path, model: Path, manifest: DeployManifest, cut: int
) -> None:
    log_path = _logged_download(tmp_path / "partial", model, manifest, [0, 3, 5])
    data = log_path.read_bytes()
    torn = 2 * RECORD.size + cut  # of the third record's write, only the first bytes landed
    log_path.write_bytes(data[:torn] + bytes(len(data) - torn))

    with PartialDownload(tmp_path / "partial", manifest) as again:
        assert again.missing() == [1, 2, 4, 5, 6, 7, 8, 9, 10]


def test_a_garbled_record_is_never_read_as_a_chunk_and_hides_only_what_follows(
    tmp_path: Path, model: Path, manifest: DeployManifest
) -> None:
    log_path = _logged_download(tmp_path / "partial", model, manifest, [0, 3, 5])
    data = bytearray(log_path.read_bytes())
    data[RECORD.size] = 7  # the second record now says chunk 7 (never written), its CRC unchanged
    data[3 * RECORD.size : 4 * RECORD.size] = RECORD.pack(9, 0)  # chunk 9 with a made-up CRC
    log_path.write_bytes(bytes(data))

    assert read_log(log_path, manifest) == [0]
    with PartialDownload(tmp_path / "partial", manifest) as again:
        assert again.missing() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_no_garbage_tail_names_a_chunk_the_log_did_not(manifest: DeployManifest) -> None:
    key = log_key(manifest)
    good = encode_records(key, [2, 4])
    rng = random.Random(7)
    for _ in range(2000):
        tail = rng.randbytes(rng.randrange(1, 4 * RECORD.size))
        assert decode_records(key, good + tail, len(manifest.chunks))[:2] == [2, 4]
        assert set(decode_records(key, good + tail, len(manifest.chunks))) <= {2, 4}


def test_another_downloads_log_names_nothing(tmp_path: Path, model: Path, manifest: DeployManifest) -> None:
    other = manifest.model_copy(update={"chunk_size": 2 * CHUNK})
    log_path = _logged_download(tmp_path / "partial", model, manifest, [0, 1])

    assert read_log(log_path, other) == []


@pytest.mark.parametrize("flush_every", [3, 5, 16])
def test_a_download_flushed_between_its_writeback_runs_stays_in_the_page_cache(
    tmp_path: Path, flush_every: int
) -> None:
    """Writeback is started per 1 MiB run of adjacent chunks, and a flush syncs in between: a run
    started over pages that flush already cleaned would drop them from the cache, and the store's
    whole-file hash would read them from the disk again."""
    model = random_model(tmp_path / "m.bin", 4 * 1024 * KIB)
    manifest = manifest_for(model, 256 * KIB)
    data = model.read_bytes()
    download = PartialDownload(tmp_path / "part", manifest, flush_every=flush_every, whole_hash=False)
    try:
        for index in range(download.chunk_count):
            assert download.write_chunk(index, data[index * 256 * KIB : (index + 1) * 256 * KIB])
        assert download.flushes >= download.chunk_count // flush_every
        path = download.finish()
    finally:
        download.close()
    assert resident_bytes(path) >= len(data) - 4 * KIB  # a page written back at once may go
    assert path.read_bytes() == data
