"""A model download in progress: ``<sha>.part`` (preallocated) plus ``<sha>.bitmap`` (verified chunks).

Crash safety rests on one ordering rule: the ``.part`` data is fsynced *before* the bitmap that
says "these chunks are there" is replaced (atomically, through :mod:`agent.fsutil`). After a crash
at any moment the bitmap therefore only names chunks whose bytes are on disk; chunks written but not
yet recorded are simply fetched again. Flushing after every chunk costs three fsyncs per chunk, so
callers batch (``flush_every``, :meth:`PartialDownload.flush`); the MQTT pull counts chunks not yet
durable against its window, which keeps "bytes fetched again after a kill" within one window.

With ``background=True`` the batches are flushed by a flusher thread, so the disk's fsyncs overlap
with receiving the next chunks: the flusher takes the batch of chunks written so far, fsyncs the
data, then writes a bitmap naming only the chunks already durable plus that batch, never a chunk
written after the batch was taken.

A bitmap that does not describe the manifest (other size, chunk size or chunk list), or a ``.part``
of the wrong size, means the leftovers belong to another attempt: they are deleted and the download
starts over. Chunks the bitmap names are re-hashed on open, so a damaged disk block costs one
chunk, not a failed job.

Layout in ``part_dir`` (see docs/delivery.md): ``<sha256>.part``, ``<sha256>.bitmap`` (JSON), and
after :meth:`PartialDownload.finish` the verified file ``<sha256>.verified`` (bitmap removed).

One job in one class, over 400 lines: the ordering rule above ties the bitmap, the data file, the
flusher thread and the re-hash on open together; split apart, the rule would live in no one place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from agent.delivery.errors import DiskFullError, HashMismatchError
from agent.errors import DeliveryError
from agent.fsutil import atomic_write_json, fsync_directory, sha256_file

if TYPE_CHECKING:
    from agent.delivery.manifest import DeployManifest

log = structlog.get_logger(__name__)

_BITMAP_VERSION = 1
_REJECT_KINDS = ("out_of_range", "bad_length", "bad_hash", "duplicate")


def chunk_list_digest(chunks: list[str]) -> str:
    """SHA-256 over the manifest's chunk hashes: identifies the chunk layout a bitmap belongs to."""
    return hashlib.sha256("\n".join(chunks).encode()).hexdigest()


class PartialDownload:
    """The on-disk state of one model download, keyed by the model's SHA-256.

    Not thread-safe: one transfer thread owns it and calls every method. With ``background=True``
    an internal flusher thread makes batches durable; it only touches the ``.part`` descriptor
    (fsync) and the bitmap, never the chunk bookkeeping the owner uses.
    """

    def __init__(
        self,
        part_dir: Path,
        manifest: DeployManifest,
        *,
        flush_every: int = 1,
        background: bool = False,
        on_durable: Callable[[], None] | None = None,
    ) -> None:
        """Open (resume) or create the partial files for ``manifest`` in ``part_dir``.

        ``flush_every``: once this many written chunks are not yet being flushed, :meth:`write_chunk`
        flushes them (itself, or with ``background`` by waking the flusher thread and returning at
        once). ``on_durable``: called on the flusher thread after each background flush (it must
        only wake its owner, e.g. put into a queue). Raises DiskFullError when the ``.part`` file
        cannot be preallocated.
        """
        if flush_every < 1:
            raise ValueError("flush_every must be >= 1")
        self.manifest = manifest
        self.part_dir = Path(part_dir)
        self.part_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self.background = background
        self.on_durable = on_durable
        sha = manifest.sha256
        self.part_path = self.part_dir / f"{sha}.part"
        self.bitmap_path = self.part_dir / f"{sha}.bitmap"
        self.verified_path = self.part_dir / f"{sha}.verified"
        self.chunk_count = len(manifest.chunks)
        expected = -(-manifest.size // manifest.chunk_size) if manifest.size else 0
        if self.chunk_count != expected:
            raise DeliveryError(
                f"manifest lists {self.chunk_count} chunk hashes but size {manifest.size} in chunks of "
                f"{manifest.chunk_size} needs {expected}; the manifest is inconsistent: rebuild it"
            )
        self.rejected: dict[str, int] = dict.fromkeys(_REJECT_KINDS, 0)
        self._have = bytearray(self.chunk_count)  # 1 = verified (written), durable or not
        self._bytes_done = 0
        #: Times the bitmap was persisted (each costs two fsyncs and a rename).
        self.flushes = 0
        # Durability bookkeeping, shared with the flusher thread under _cond: chunks written and not
        # yet taken by a flush (_pending), the batch a flush is making durable (_flushing), and the
        # bitmap of what is durable (_durable_bits, bit i of byte i/8), which is what gets written.
        self._cond = threading.Condition()
        self._pending: list[int] = []
        self._flushing: list[int] = []
        self._flush_asked = False
        self._flush_error: BaseException | None = None
        self._stopping = False
        self._flusher: threading.Thread | None = None
        self._io_lock = threading.Lock()  # one flush (fsync + bitmap) at a time, either thread
        self._durable_bits = bytearray((self.chunk_count + 7) // 8)
        # Whole-file SHA-256 over the chunks 0.._prefix_end-1, fed as they are written, so finish()
        # need not read the file again when this process wrote it all (mostly in order).
        self._prefix_hash = hashlib.sha256()
        self._prefix_end = 0
        self._fd: int | None = None
        self._finished = self.verified_path.exists() and self.verified_path.stat().st_size == manifest.size
        if self._finished:
            self._have = bytearray(b"\x01" * self.chunk_count)
            self._bytes_done = manifest.size
        else:
            self._open()

    # -- opening ---------------------------------------------------------------------------------

    def _bitmap_header(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "version": _BITMAP_VERSION,
            "sha256": m.sha256,
            "size": m.size,
            "chunk_size": m.chunk_size,
            "chunks": chunk_list_digest(list(m.chunks)),
        }

    def _read_bitmap(self) -> bytearray | None:
        """The chunks the bitmap says are durable, or None when it does not describe this manifest."""
        try:
            data = json.loads(self.bitmap_path.read_text())
            if not isinstance(data, dict):
                return None
            header = {k: data.get(k) for k in self._bitmap_header()}
            if header != self._bitmap_header():
                return None
            bits = bytes.fromhex(str(data["done"]))
        except (OSError, ValueError, KeyError):
            return None
        if len(bits) != (self.chunk_count + 7) // 8:
            return None
        return bytearray((bits[i >> 3] >> (i & 7)) & 1 for i in range(self.chunk_count))

    def _open(self) -> None:
        have = self._read_bitmap()
        part_ok = self.part_path.exists() and self.part_path.stat().st_size == self.manifest.size
        if have is None or not part_ok:
            if self.part_path.exists() or self.bitmap_path.exists():
                log.info(
                    "delivery.partial.restart", sha256=self.manifest.sha256, reason="bitmap or part mismatch"
                )
            for path in (self.part_path, self.bitmap_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            have = bytearray(self.chunk_count)
            part_ok = False
        self._fd = os.open(self.part_path, os.O_RDWR | os.O_CREAT, 0o644)
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
                self._durable_bits[i >> 3] |= 1 << (i & 7)
                if i == self._prefix_end:
                    self._prefix_hash.update(data)
                    self._prefix_end += 1
        self._have = have
        self._bytes_done = sum(self.chunk_length(i) for i in range(self.chunk_count) if have[i])
        if bad:
            log.warning(
                "delivery.partial.damaged", sha256=self.manifest.sha256, chunks=bad[:16], count=len(bad)
            )
            self.flush(force=True)
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
        start = index * self.manifest.chunk_size
        return min(self.manifest.chunk_size, self.manifest.size - start)

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
        """Chunks written but not yet recorded in the bitmap on disk (fetched again after a crash).

        Counts the batch a background flush is making durable right now, too.
        """
        with self._cond:
            return len(self._pending) + len(self._flushing)

    @property
    def flushing(self) -> bool:
        """True while a background flush is running."""
        with self._cond:
            return bool(self._flushing)

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
        if (digest or hashlib.sha256(data).hexdigest()) != self.manifest.chunks[index]:
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
        offset = index * self.manifest.chunk_size
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view = view[written:]
            offset += written
        self._have[index] = 1
        self._bytes_done += len(data)
        with self._cond:
            # Appended only after pwrite returned: a flush that takes this index fsyncs after it.
            self._pending.append(index)
            due = len(self._pending) >= self.flush_every
            if due and self.background:
                self._cond.notify_all()
        self._extend_prefix_hash(index, data)
        if due and not self.background:
            self.flush()
        elif due:
            self._start_flusher()
        return True

    def _extend_prefix_hash(self, index: int, data: bytes) -> None:
        if index != self._prefix_end:
            return
        self._prefix_hash.update(data)
        self._prefix_end += 1
        # Chunks that arrived early (or were there before a resume) are read back once.
        while self._prefix_end < self.chunk_count and self._have[self._prefix_end]:
            assert self._fd is not None
            start = self._prefix_end * self.manifest.chunk_size
            self._prefix_hash.update(os.pread(self._fd, self.chunk_length(self._prefix_end), start))
            self._prefix_end += 1

    # -- durability ------------------------------------------------------------------------------

    def flush(self, *, force: bool = False) -> None:
        """Make written chunks durable now: fsync the ``.part``, then atomically replace the bitmap.

        Waits for a background flush that is running. Raises the error of a failed one.
        """
        self.raise_flush_error()
        with self._io_lock:
            with self._cond:
                if self._fd is None or (not self._pending and not force):
                    return
                batch, self._pending = self._pending, []
                self._flushing = batch
            try:
                self._persist(batch)
            except BaseException:
                with self._cond:
                    self._pending[:0] = batch  # not recorded: still at risk
                raise
            finally:
                with self._cond:
                    self._flushing = []
                    self._cond.notify_all()

    def request_flush(self) -> None:
        """Flush what is written without waiting (``background``; otherwise the same as :meth:`flush`).

        The flusher takes the chunks written so far as soon as it is idle; :attr:`unflushed`
        drops when they are durable, and ``on_durable`` is called.
        """
        self.raise_flush_error()
        if not self.background:
            self.flush()
            return
        with self._cond:
            if not self._pending:
                return
            self._flush_asked = True
            self._cond.notify_all()
        self._start_flusher()

    def _persist(self, batch: list[int]) -> None:
        """fsync the data of ``batch`` (written before this call), then record it in the bitmap."""
        assert self._fd is not None
        if batch:
            if hasattr(os, "fdatasync"):
                os.fdatasync(self._fd)  # the data blocks are what matters; the size never changes
            else:
                os.fsync(self._fd)
        # Only durable chunks go into the bitmap: those of earlier flushes and this batch.
        bits = bytearray(self._durable_bits)
        for i in batch:
            bits[i >> 3] |= 1 << (i & 7)
        atomic_write_json(self.bitmap_path, {**self._bitmap_header(), "done": bits.hex()}, indent=None)
        self._durable_bits = bits
        self.flushes += 1

    def _start_flusher(self) -> None:
        if self._flusher is None and self._fd is not None:
            self._flusher = threading.Thread(
                target=self._run_flusher, name=f"partial-flush-{self.manifest.sha256[:8]}", daemon=True
            )
            self._flusher.start()

    def _batch_due(self) -> bool:
        """True when the flusher should take the pending chunks (call with ``_cond`` held)."""
        return bool(self._pending) and (self._flush_asked or len(self._pending) >= self.flush_every)

    def _take_batch(self) -> list[int]:
        """Move the pending chunks into the flushing batch (call with ``_cond`` held)."""
        self._flush_asked = False
        batch, self._pending = self._pending, []
        self._flushing = batch
        return batch

    def _run_flusher(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._batch_due())
                if self._stopping:
                    return
            with self._io_lock:
                with self._cond:
                    if self._stopping or self._fd is None:
                        return
                    batch = self._take_batch()
                while batch:
                    try:
                        self._persist(batch)
                    except BaseException as exc:  # noqa: BLE001 - handed to the owner, raised there
                        log.error(
                            "delivery.partial.flush_failed", sha256=self.manifest.sha256, error=repr(exc)
                        )
                        with self._cond:
                            self._flush_error = exc
                            self._cond.notify_all()
                        self._notify_durable()
                        return  # the batch stays at risk, and nothing after it is recorded
                    with self._cond:
                        # The next batch is taken before the owner hears of this one, so a
                        # flush is always seen running while chunks wait for one.
                        due = self._batch_due() and not self._stopping
                        self._flushing = []
                        batch = self._take_batch() if due else []
                        self._cond.notify_all()
                    self._notify_durable()

    def _notify_durable(self) -> None:
        if self.on_durable is None:
            return
        try:
            self.on_durable()
        except Exception as exc:  # noqa: BLE001 - a listener must not kill the flusher
            log.error("delivery.partial.listener_failed", error=repr(exc))

    def raise_flush_error(self) -> None:
        """Raise the error of a failed background flush (an OSError from fsync or the bitmap write)."""
        with self._cond:
            error = self._flush_error
        if error is not None:
            raise error

    def _stop_flusher(self) -> None:
        """Let a running background flush finish, then end the flusher thread."""
        flusher = self._flusher
        if flusher is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        flusher.join()
        self._flusher = None
        with self._cond:
            self._stopping = False

    # -- the end ---------------------------------------------------------------------------------

    def finish(self) -> Path:
        """Check the whole file's SHA-256 and return ``<sha>.verified``; the bitmap is removed.

        Raises DeliveryError if chunks are missing, HashMismatchError (files deleted) if every chunk
        matched but the whole file does not (the manifest contradicts itself).
        """
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
        if self._prefix_end == self.chunk_count:
            actual = self._prefix_hash.hexdigest()
        else:
            actual = sha256_file(self.part_path)
        if actual != self.manifest.sha256:
            self.discard()
            raise HashMismatchError(self._mismatch_message(actual))
        os.replace(self.part_path, self.verified_path)
        fsync_directory(self.part_dir)
        with contextlib.suppress(FileNotFoundError):
            self.bitmap_path.unlink()
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
        self._stop_flusher()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close and delete every file of this download."""
        self.close()
        for path in (self.part_path, self.bitmap_path, self.verified_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._have = bytearray(self.chunk_count)
        self._bytes_done = 0
        with self._cond:
            self._pending = []
            self._flushing = []
            self._flush_error = None
        self._durable_bits = bytearray((self.chunk_count + 7) // 8)
        self._prefix_hash = hashlib.sha256()
        self._prefix_end = 0
        self._finished = False

    def __enter__(self) -> PartialDownload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
