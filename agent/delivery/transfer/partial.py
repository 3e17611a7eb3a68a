"""A model download in progress: ``<sha>.part`` (preallocated) plus the record of verified chunks.

The record is ``<sha>.bitmap`` (a snapshot) and ``<sha>.log`` (chunks recorded since). Crash safety
rests on one ordering rule: the ``.part`` data is fsynced *before* the record that says "these
chunks are there" is written, so after a crash the record only names chunks whose bytes are on
disk. :mod:`agent.delivery.transfer.flusher` keeps that rule (in batches, optionally on a flusher
thread); :mod:`agent.delivery.transfer.bitmap` and :mod:`agent.delivery.transfer.chunk_log` are the
formats. This module is the
download itself: the files, verified chunk writes, resume and the final whole-file check.

A bitmap that does not describe the manifest (other size, chunk size or chunk list), or a ``.part``
of the wrong size, means the leftovers belong to another attempt: they are deleted and the download
starts over. Chunks the bitmap names are re-hashed on open, so a damaged disk block costs one
chunk, not a failed job.

Layout in ``part_dir`` (see docs/delivery.md): ``<sha256>.part``, ``<sha256>.bitmap`` (JSON),
``<sha256>.log`` (8-byte records), and after :meth:`PartialDownload.finish` the verified file
``<sha256>.verified`` (bitmap and log removed).

"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from agent.delivery.transfer.flusher import ChunkFlusher, read_record
from agent.errors import DeliveryError
from agent.fsutil import fsync_directory, sha256_file, start_writeback
from agent.protocol.delivery_errors import DiskFullError, HashMismatchError

if TYPE_CHECKING:
    from agent.protocol.manifest import DeployManifest

log = structlog.get_logger(__name__)

_REJECT_KINDS = ("out_of_range", "bad_length", "bad_hash", "duplicate")
#: Writeback is started per run of adjacent written chunks this long: each call costs a fixed part
#: (the filesystem maps the range), which one call per small chunk paid again and again.
WRITEBACK_RUN = 1024 * 1024


class PartialDownload:
    """The on-disk state of one model download, keyed by the model's SHA-256.

    Not thread-safe: one transfer thread owns it and calls every method. With ``background=True``
    its :class:`~agent.delivery.transfer.flusher.ChunkFlusher` makes batches durable on a thread of its
    own; that thread only touches the ``.part`` descriptor (fsync) and the bitmap, never the chunk
    bookkeeping the owner uses.
    """

    def __init__(
        self,
        part_dir: Path,
        manifest: DeployManifest,
        *,
        flush_every: int = 1,
        background: bool = False,
        on_durable: Callable[[], None] | None = None,
        whole_hash: bool = True,
    ) -> None:
        """Open (resume) or create the partial files for ``manifest`` in ``part_dir``.

        ``flush_every``: once this many written chunks are not yet being flushed, :meth:`write_chunk`
        flushes them (itself, or with ``background`` by waking the flusher thread and returning at
        once). ``on_durable``: called on the flusher thread after each background flush (it must
        only wake its owner, e.g. put into a queue). ``whole_hash`` False: :meth:`finish` checks
        that every chunk is there and verified but leaves the whole file's SHA-256 to whoever adopts
        the file (the model store does: hashing every byte a third time here is a cost, not a check).
        Raises DiskFullError when the ``.part`` file cannot be preallocated.
        """
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.manifest = manifest
        self.part_dir = Path(part_dir)
        self.part_dir.mkdir(parents=True, exist_ok=True)
        sha = manifest.sha256
        self.part_path = self.part_dir / f"{sha}.part"
        self.bitmap_path = self.part_dir / f"{sha}.bitmap"
        self.log_path = self.part_dir / f"{sha}.log"
        self.verified_path = self.part_dir / f"{sha}.verified"
        self.chunk_count = len(manifest.chunks)
        # Read per chunk: plain attributes, not the manifest model's.
        self._chunk_size, self._size, self._chunk_hashes = manifest.chunk_size, manifest.size, manifest.chunks
        expected = -(-manifest.size // manifest.chunk_size) if manifest.size else 0
        if self.chunk_count != expected:
            raise DeliveryError(
                f"manifest lists {self.chunk_count} chunk hashes but size {manifest.size} in chunks of "
                f"{manifest.chunk_size} needs {expected}; the manifest is inconsistent: rebuild it"
            )
        self.rejected: dict[str, int] = dict.fromkeys(_REJECT_KINDS, 0)
        self._have = bytearray(self.chunk_count)  # 1 = verified (written), durable or not
        self._bytes_done = 0
        # Shared with its flusher thread: the durability bookkeeping, under a lock of its own.
        self._flusher = ChunkFlusher(
            manifest,
            self.bitmap_path,
            self.log_path,
            flush_every=flush_every,
            background=background,
            on_durable=on_durable,
        )
        # Whole-file SHA-256 over the chunks 0.._prefix_end-1, fed as they are written, so finish()
        # need not read the file again when this process wrote it all (mostly in order).
        self._prefix_hash = hashlib.sha256()
        self._prefix_end = 0
        # Bytes written whose writeback has not been started: [start, end) of adjacent chunks, and
        # the flusher's count of syncs begun when the run began.
        self._run_start = self._run_end = self._run_syncs = 0
        self._whole_hash = whole_hash
        self._fd: int | None = None
        self._finished = self.verified_path.exists() and self.verified_path.stat().st_size == manifest.size
        if self._finished:
            self._have = bytearray(b"\x01" * self.chunk_count)
            self._bytes_done = manifest.size
        else:
            self._open()

    # -- opening ---------------------------------------------------------------------------------

    def _open(self) -> None:
        have = read_record(self.bitmap_path, self.log_path, self.manifest)
        part_ok = self.part_path.exists() and self.part_path.stat().st_size == self.manifest.size
        if have is None or not part_ok:
            if self.part_path.exists() or self.bitmap_path.exists():
                log.info(
                    "delivery.partial.restart", sha256=self.manifest.sha256, reason="bitmap or part mismatch"
                )
            for path in (self.part_path, self.bitmap_path, self.log_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            have = bytearray(self.chunk_count)
            part_ok = False
        self._fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT, 0o644)
        self._flusher.fd = self._fd  # the flusher syncs the same descriptor
        if not part_ok:
            self._preallocate()
            self._have = have
            self._bytes_done = 0
            self.flush(force=True)
            return
        # Re-verify what the bitmap names: a chunk damaged on disk is fetched again, not trusted.
        bad = []
        for i in range(self.chunk_count):
            if not have[i]:
                continue
            data = self._read_verified(i)
            if data is None:
                bad.append(i)
                have[i] = 0
            else:
                self._flusher.mark_durable(i)
                if self._whole_hash and i == self._prefix_end:
                    self._prefix_hash.update(data)
                    self._prefix_end += 1
        self._have = have
        self._bytes_done = sum(self.chunk_length(i) for i in range(self.chunk_count) if have[i])
        if bad:
            log.warning(
                "delivery.partial.damaged", sha256=self.manifest.sha256, chunks=bad[:16], count=len(bad)
            )
        self.flush(force=True)  # the bitmap names what was verified; the log starts empty
        log.info(
            "delivery.partial.resumed",
            sha256=self.manifest.sha256,
            have=sum(self._have),
            chunks=self.chunk_count,
        )

    def _preallocate(self) -> None:
        assert self._fd is not None
        size = self.manifest.size
        try:
            try:
                os.posix_fallocate(self._fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(self._fd, size)  # file system without fallocate (tmpfs on old kernels, ...)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.close()
                with contextlib.suppress(FileNotFoundError):
                    self.part_path.unlink()
                raise DiskFullError(
                    f"cannot reserve {size} bytes for {self.part_path} ({exc.strerror}); free disk space "
                    "under the state directory, then publish the manifest again"
                ) from exc
            raise

    def _read_verified(self, index: int) -> bytes | None:
        """Chunk ``index`` as on disk if it matches its hash, else None."""
        assert self._fd is not None
        length = self.chunk_length(index)
        data = os.pread(self._fd, length, index * self.manifest.chunk_size)
        if len(data) == length and hashlib.sha256(data).hexdigest() == self.manifest.chunks[index]:
            return data
        return None

    # -- queries ---------------------------------------------------------------------------------

    def chunk_length(self, index: int) -> int:
        """Length of chunk ``index`` (the last one may be short)."""
        return min(self._chunk_size, self._size - index * self._chunk_size)

    def has(self, index: int) -> bool:
        """True when chunk ``index`` is written and verified (durable or not yet flushed)."""
        return 0 <= index < self.chunk_count and bool(self._have[index])

    def missing(self) -> list[int]:
        """Indices of the chunks not written yet, in file order."""
        return [i for i in range(self.chunk_count) if not self._have[i]]

    @property
    def complete(self) -> bool:
        """True when every chunk is written and verified."""
        return self._finished or all(self._have)

    @property
    def bytes_done(self) -> int:
        """Bytes of the verified chunks."""
        return self._bytes_done

    @property
    def unflushed(self) -> int:
        """Chunks written but not yet recorded on disk (fetched again after a crash).

        Counts the batch a background flush is making durable right now, too.
        """
        return self._flusher.unflushed

    @property
    def flushing(self) -> bool:
        """True while a background flush is running."""
        return self._flusher.flushing

    @property
    def flushes(self) -> int:
        """Times written chunks were recorded durably (each costs two syncs)."""
        return self._flusher.flushes

    @property
    def flush_s(self) -> float:
        """Seconds the flushes took in all (the data's sync and the record's)."""
        return self._flusher.flush_s

    @property
    def flush_every(self) -> int:
        """Written chunks not yet being flushed that make a flush due."""
        return self._flusher.flush_every

    @property
    def background(self) -> bool:
        """True when a flusher thread makes batches durable."""
        return self._flusher.background

    @property
    def on_durable(self) -> Callable[[], None] | None:
        """Called on the flusher thread after each background flush (it must only wake its owner)."""
        return self._flusher.on_durable

    @on_durable.setter
    def on_durable(self, listener: Callable[[], None] | None) -> None:
        self._flusher.on_durable = listener

    def contiguous_offset(self) -> int:
        """Byte offset of the first missing chunk (``size`` when complete): where a stream resumes."""
        for i in range(self.chunk_count):
            if not self._have[i]:
                return i * self.manifest.chunk_size
        return self.manifest.size

    # -- writing ---------------------------------------------------------------------------------

    def check_chunk(self, index: int, data: bytes, digest: str | None = None) -> str | None:
        """Why ``data`` cannot be chunk ``index`` (a reject kind), or None when it is acceptable.

        ``digest``: the SHA-256 of ``data`` if the caller already computed it (from ``data``!).
        """
        if not 0 <= index < self.chunk_count:
            return "out_of_range"
        if self._have[index]:
            return "duplicate"
        if len(data) != self.chunk_length(index):
            return "bad_length"
        if (digest or hashlib.sha256(data).hexdigest()) != self._chunk_hashes[index]:
            return "bad_hash"
        return None

    def write_chunk(self, index: int, data: bytes, digest: str | None = None) -> bool:
        """Verify ``data`` as chunk ``index`` and write it; False (counted in ``rejected``) if refused.

        Refused, and never written: an index out of range, a chunk already written ("duplicate"), a
        wrong length, a SHA-256 that differs from ``manifest.chunks[index]``. ``digest``: the
        SHA-256 hex of ``data`` when the caller computed it already (the MQTT pull hashes on the
        thread that receives, so hashing overlaps with disk work here). Raises the error of a
        failed background flush.
        """
        self.raise_flush_error()
        if self._finished:
            self.rejected["duplicate"] += 1
            return False
        problem = self.check_chunk(index, data, digest)
        if problem is not None:
            self.rejected[problem] += 1
            return False
        assert self._fd is not None
        start = offset = index * self._chunk_size
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view = view[written:]
            offset += written
        self._written_run(start, len(data))
        self._have[index] = 1
        self._bytes_done += len(data)
        due = self._flusher.written(index)
        self._extend_prefix_hash(index, data)
        if due:
            self._flusher.flush_due()
        return True

    def _written_run(self, start: int, length: int) -> None:
        """Start the writeback of what was written, a run of adjacent chunks at a time.

        The flush that makes these chunks durable then waits for less (it runs while the window is
        held: the shorter it is, the sooner the next chunks are asked for).
        """
        syncs = self._flusher.syncs_started
        if syncs != self._run_syncs:
            # A sync begun since the run began writes its pages itself; started again here, the
            # pages it already cleaned would be dropped from the cache the whole-file hash reads.
            self._begin_run(start)
        elif start != self._run_end:
            self._start_run_writeback()
            self._begin_run(start)
        self._run_end = start + length
        if self._run_end - self._run_start >= WRITEBACK_RUN:
            self._start_run_writeback()

    def _begin_run(self, start: int) -> None:
        self._run_start = self._run_end = start
        self._run_syncs = self._flusher.syncs_started

    def _start_run_writeback(self) -> None:
        if self._run_end > self._run_start and self._fd is not None:
            start_writeback(self._fd, self._run_start, self._run_end - self._run_start)
        self._run_start = self._run_end

    def _extend_prefix_hash(self, index: int, data: bytes) -> None:
        if not self._whole_hash or index != self._prefix_end:
            return
        self._prefix_hash.update(data)
        self._prefix_end += 1
        # Chunks that arrived early (or were there before a resume) are read back once.
        while self._prefix_end < self.chunk_count and self._have[self._prefix_end]:
            assert self._fd is not None
            start = self._prefix_end * self.manifest.chunk_size
            self._prefix_hash.update(os.pread(self._fd, self.chunk_length(self._prefix_end), start))
            self._prefix_end += 1

    # -- durability (agent.delivery.transfer.flusher) ---------------------------------------------

    def flush(self, *, force: bool = False) -> None:
        """Make written chunks durable now: fsync the ``.part``, then record them (``force``: rewrite
        the bitmap and empty the log even when nothing is pending).

        Waits for a background flush that is running. Raises the error of a failed one.
        """
        self._flusher.flush(force=force)

    def request_flush(self) -> None:
        """Flush what is written without waiting (``background``; otherwise the same as :meth:`flush`).

        The flusher takes the chunks written so far as soon as it is idle; :attr:`unflushed`
        drops when they are durable, and ``on_durable`` is called.
        """
        self._flusher.request_flush()

    def raise_flush_error(self) -> None:
        """Raise the error of a failed background flush (an OSError from a sync or a record write)."""
        self._flusher.raise_flush_error()

    # -- the end ---------------------------------------------------------------------------------

    def finish(self) -> Path:
        """Check the whole file's SHA-256 and return ``<sha>.verified``; bitmap and log are removed.

        Raises DeliveryError if chunks are missing, HashMismatchError (files deleted) if every chunk
        matched but the whole file does not (the manifest contradicts itself). Without ``whole_hash``
        only the chunks are checked (each was, against the manifest, when it was written or resumed).
        """
        if self._finished and not self._whole_hash:
            return self.verified_path
        if self._finished:
            actual = sha256_file(self.verified_path)
            if actual == self.manifest.sha256:
                return self.verified_path
            self.discard()
            raise HashMismatchError(self._mismatch_message(actual))
        missing = self.missing()
        if missing:
            raise DeliveryError(f"download incomplete: {len(missing)} of {self.chunk_count} chunks missing")
        self.flush()
        self.close()
        if not self._whole_hash:
            actual = self.manifest.sha256
        elif self._prefix_end == self.chunk_count:
            actual = self._prefix_hash.hexdigest()
        else:
            actual = sha256_file(self.part_path)
        if actual != self.manifest.sha256:
            self.discard()
            raise HashMismatchError(self._mismatch_message(actual))
        os.replace(self.part_path, self.verified_path)
        fsync_directory(self.part_dir)
        for path in (self.bitmap_path, self.log_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._finished = True
        log.info("delivery.partial.verified", sha256=self.manifest.sha256, size=self.manifest.size)
        return self.verified_path

    def _mismatch_message(self, actual: str) -> str:
        return (
            f"assembled model has SHA-256 {actual} but the manifest says {self.manifest.sha256} although "
            "every chunk matched its hash: the manifest is inconsistent; rebuild and publish it again"
        )

    def close(self) -> None:
        """Close the ``.part`` file, after a running background flush ends.

        Chunks not yet taken by a flush are not flushed (call :meth:`flush` first to keep them).
        """
        self._flusher.stop()
        self._flusher.close_log()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._flusher.fd = None

    def discard(self) -> None:
        """Close and delete every file of this download."""
        self.close()
        for path in (self.part_path, self.bitmap_path, self.log_path, self.verified_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._have = bytearray(self.chunk_count)
        self._bytes_done = 0
        self._flusher.reset()
        self._prefix_hash = hashlib.sha256()
        self._prefix_end = 0
        self._begin_run(0)
        self._finished = False

    def __enter__(self) -> PartialDownload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
