"""Make a download's written chunks durable in batches: fsync the ``.part``, then record them.

Crash safety rests on one ordering rule: the ``.part`` data is fsynced *before* the record that
says "these chunks are there" is written. The record is the bitmap (a snapshot, replaced atomically
through :mod:`agent.fsutil`) plus the log of chunks made durable since
(:mod:`agent.delivery.transfer.chunk_log`): a flush appends the batch to the log and fdatasyncs it,
two syncs in all; the bitmap is rewritten, and the log emptied, only when the download is opened or
asked to (``force``). After a crash at any moment the record therefore only names chunks whose
bytes are on disk; chunks written but not yet recorded are simply fetched again. Flushing after
every chunk costs two syncs per chunk, so callers batch (``flush_every``,
:meth:`ChunkFlusher.flush`); the MQTT pull counts chunks not yet durable against its window,
which keeps "bytes fetched again after a kill" within one window.

With ``background=True`` the batches are flushed by a flusher thread, so the disk's fsyncs overlap
with receiving the next chunks: the flusher takes the batch of chunks written so far, fsyncs the
data, then records only that batch, never a chunk written after the batch was taken.

This is the part of a :class:`~agent.delivery.transfer.partial.PartialDownload` that two threads share; the
download's owner thread writes the chunks and tells this class which (:meth:`ChunkFlusher.written`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from agent.delivery.transfer.bitmap import bitmap_record, empty_bits, read_bitmap, set_bit
from agent.delivery.transfer.chunk_log import ChunkLog, read_log
from agent.fsutil import atomic_write_json

if TYPE_CHECKING:
    from agent.protocol.manifest import DeployManifest

log = structlog.get_logger(__name__)


def read_record(bitmap_path: Path, log_path: Path, manifest: DeployManifest) -> bytearray | None:
    """The chunks the durable record names, one byte each (1 = durable): the bitmap with the log's
    chunks set; None when the bitmap is missing, unreadable or for another manifest."""
    have = read_bitmap(bitmap_path, manifest)
    if have is not None:
        for i in read_log(log_path, manifest):
            have[i] = 1
    return have


class ChunkFlusher:
    """The durability bookkeeping of one download: chunks written, the batch being flushed, the
    bitmap of what is durable. Its owner calls every public method; with ``background`` an internal
    flusher thread makes batches durable, touching only the ``.part`` descriptor (fsync), the bitmap
    and this bookkeeping, which it shares with the owner under one condition.
    """

    def __init__(
        self,
        manifest: DeployManifest,
        bitmap_path: Path,
        log_path: Path,
        *,
        flush_every: int,
        background: bool,
        on_durable: Callable[[], None] | None,
    ) -> None:
        self.manifest = manifest
        self.bitmap_path = bitmap_path
        self.log_path = log_path
        self._log: ChunkLog | None = None
        self._log_torn = False
        self.flush_every = flush_every
        self.background = background
        self.on_durable = on_durable
        #: The ``.part`` descriptor; its owner sets it when open, clears it when closed.
        self.fd: int | None = None
        #: Times written chunks were recorded durably (each costs two syncs).
        self.flushes = 0
        #: Seconds those flushes took in all (the data's sync and the record's): the time a batch
        #: holds its half of the window after it was written.
        self.flush_s = 0.0
        self._chunk_count = len(manifest.chunks)
        # Shared with the flusher thread under _cond: chunks written and not yet taken by a flush
        # (_pending), the batch a flush is making durable (_flushing), and the bitmap of what is
        # durable (_durable_bits, bit i of byte i/8), which is what gets written.
        self._cond = threading.Condition()
        self._pending: list[int] = []
        self._flushing: list[int] = []
        self._flush_asked = False
        self._flush_error: BaseException | None = None
        self._stopping = False
        self._flusher: threading.Thread | None = None
        self._io_lock = threading.Lock()  # one flush (fsync + record) at a time, either thread
        self._durable_bits = empty_bits(self._chunk_count)
        #: Syncs of the data begun so far (counted before each starts; read without the lock).
        self.syncs_started = 0

    def mark_durable(self, index: int) -> None:
        """Chunk ``index`` is already durable (named by the bitmap on open and re-verified)."""
        set_bit(self._durable_bits, index)

    def written(self, index: int) -> bool:
        """Chunk ``index`` was written (its ``pwrite`` returned); True when a flush is now due.

        The owner then calls :meth:`flush_due`, after any work of its own.
        """
        with self._cond:
            # Appended only after pwrite returned: a flush that takes this index fsyncs after it.
            self._pending.append(index)
            due = len(self._pending) >= self.flush_every
            if due and self.background:
                self._cond.notify_all()
        return due

    def flush_due(self) -> None:
        """Flush the due batch: here, or with ``background`` by starting the flusher thread."""
        if not self.background:
            self.flush()
        else:
            self._start_flusher()

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

    def flush(self, *, force: bool = False) -> None:
        """Make written chunks durable now: fsync the ``.part``, then record them.

        ``force``: rewrite the bitmap (atomically) and empty the log even when nothing is pending.
        Waits for a background flush that is running. Raises the error of a failed one.
        """
        self.raise_flush_error()
        with self._io_lock:
            with self._cond:
                if self.fd is None or (not self._pending and not force):
                    return
                batch, self._pending = self._pending, []
                self._flushing = batch
            try:
                self._persist(batch, compact=force)
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

    def _persist(self, batch: list[int], *, compact: bool = False) -> None:
        """fsync the data of ``batch`` (written before this call), then record it: appended to the
        log, or with ``compact`` in a new bitmap, after which the log is emptied."""
        assert self.fd is not None
        started = time.monotonic()
        if batch:
            self.syncs_started += 1
            if hasattr(os, "fdatasync"):
                os.fdatasync(self.fd)  # the data blocks are what matters; the size never changes
            else:
                os.fsync(self.fd)
        bits = bytearray(self._durable_bits)
        for i in batch:
            set_bit(bits, i)
        if self._log is None:
            # Created before the bitmap is written, whose directory fsync then keeps the log's name.
            self._log = ChunkLog(self.log_path, self.manifest)
            compact = True
        if compact or self._log_torn:
            atomic_write_json(self.bitmap_path, bitmap_record(self.manifest, bits), indent=None)
            self._log.clear()  # everything it named is in the bitmap now
            self._log_torn = False
        elif batch:
            # A failed append may leave a partial record, which hides any appended after it.
            self._log_torn = True
            self._log.append(batch)
            self._log_torn = False
        self._durable_bits = bits
        self.flushes += 1
        self.flush_s += time.monotonic() - started

    def _start_flusher(self) -> None:
        if self._flusher is None and self.fd is not None:
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
                    if self._stopping or self.fd is None:
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
        """Raise the error of a failed background flush (an OSError from a sync or a record write)."""
        error = self._flush_error  # one read, set once by the flusher: no lock (asked per chunk)
        if error is not None:
            raise error

    def stop(self) -> None:
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

    def close_log(self) -> None:
        """Close the log file (after :meth:`stop`); the next flush opens it again and rewrites the bitmap."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def reset(self) -> None:
        """Forget every chunk (the download's files were deleted); call after :meth:`stop`."""
        with self._cond:
            self._pending = []
            self._flushing = []
            self._flush_error = None
        self._durable_bits = empty_bits(self._chunk_count)
