"""SQLite outbox for MQTT messages that must not be lost (job status, durable results).

A message is written (and fsynced: WAL + ``synchronous=FULL``) before it is sent, and deleted only
when the broker acknowledged it, so a broker outage, a crash or a power cut loses nothing; the
price is a possible duplicate, which consumers drop by ``msg_id``. A small key/value table keeps
the link's state that must survive restarts (the session counter).

Bounded (:class:`~agent.spool.settings.SpoolSettings`): at ``max_rows`` or ``max_bytes`` the oldest
durable *results* make room (or new ones are refused, ``results_at_cap: drop_newest``); *job states*
are never dropped. Results carry a time-to-live: an expired one is deleted when the replay reaches it
instead of being published. A full disk never raises for a result: it is dropped and counted, and
warned about once per episode (from the first failed write to the first write that succeeds with
:data:`~agent.spool.episodes.WRITE_RECOVERED_FREE_BYTES` free on the disk); a job state raises
:class:`SpoolWriteError` so the caller can keep it in memory instead. Each write is one
transaction, and :meth:`Spool.add_many` writes a whole batch in one, so a publisher of many results
pays one fsync per batch, not one per result.

One job (a capped, crash-safe outbox): the cap, the eviction order and the TTL live in the same
transactions as the rows they change; apart, a crash between them would break the cap. The file's
tables and their upgrade are :mod:`agent.spool.schema`; the figures and the once-per-episode log
lines (at the cap, writes failing) are :mod:`agent.spool.episodes`, changed here under the same lock
right after each transaction.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import structlog

from agent.errors import TransportError
from agent.spool.episodes import SpoolEpisodes
from agent.spool.schema import open_outbox
from agent.spool.settings import SpoolSettings

log = structlog.get_logger(__name__)

#: ``state``: never dropped, never expires (job states). ``result``: dropped at the cap, expires.
MessageKind = Literal["state", "result"]
_KIND_CODE: dict[str, int] = {"state": 0, "result": 1}

#: Bytes a row costs beyond its payload and topic (rowid, columns, b-tree cell), for the byte cap.
ROW_OVERHEAD = 40


class SpoolWriteError(TransportError):
    """The spool could not store a message (disk full, I/O error); nothing was written."""


@dataclass(frozen=True)
class SpoolEntry:
    """A message to store."""

    topic: str
    payload: bytes
    retain: bool = False
    kind: MessageKind = "state"

    @property
    def size(self) -> int:
        """Bytes it counts against ``max_bytes``."""
        return len(self.payload) + len(self.topic.encode()) + ROW_OVERHEAD


@dataclass(frozen=True)
class SpooledMessage:
    """One message waiting in the outbox."""

    id: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    expires_at: float | None = None  # wall-clock time after which it is deleted instead of sent


class Spool:
    """The outbox at ``path`` (created if missing). Thread-safe: one connection behind one lock."""

    def __init__(
        self,
        path: Path,
        settings: SpoolSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.settings = settings or SpoolSettings()
        self._clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._episodes = SpoolEpisodes(path, self.settings)
        self._n = self._episodes.n
        self._unremoved: set[int] = set()  # acknowledged, but the DELETE failed (disk full): retried
        # Rows up to this id were handed to the MQTT client: they are in its memory and resent after a
        # reconnect, so evicting them would drop nothing; the cap evicts only rows after it.
        self._sent_upto = 0
        try:
            self._db = open_outbox(path)
            rows, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length(payload) + length(topic)), 0) FROM outbox"
            ).fetchone()
        except sqlite3.Error as exc:
            raise TransportError(
                f"cannot open the message spool {path}: {exc}; check that the state directory is "
                "writable and the disk is not full (delete the file only if losing queued messages is "
                "acceptable)"
            ) from exc
        self._n.rows = int(rows)
        self._n.bytes = int(size) + ROW_OVERHEAD * int(rows)
        self._closed = False

    # -- writing -------------------------------------------------------------------------------

    @overload
    def add(
        self, topic: str, payload: bytes, qos: int, retain: bool, *, kind: Literal["state"] = "state"
    ) -> int: ...
    @overload
    def add(self, topic: str, payload: bytes, qos: int, retain: bool, *, kind: MessageKind) -> int | None: ...
    def add(
        self, topic: str, payload: bytes, qos: int, retain: bool, *, kind: MessageKind = "state"
    ) -> int | None:
        """Store one message durably; its id (ids strictly increase, also across restarts).

        None when a result was not stored (dropped at the cap or on a failed write; counted). Raises
        :class:`SpoolWriteError` when a job state could not be written. ``qos`` is always 1 here.
        """
        del qos  # spooled messages are always sent with QoS 1
        return self.add_many([SpoolEntry(topic, payload, retain, kind)])[0]

    def add_many(self, entries: Sequence[SpoolEntry], *, raise_on_failure: bool = False) -> list[int | None]:
        """Store a batch in one transaction (one fsync); the id of each, None for a dropped result.

        Raises :class:`SpoolWriteError` (nothing stored) when the write failed and the batch holds a
        job state, or ``raise_on_failure`` (the caller has somewhere else to put them: nothing is
        counted as dropped); a batch of results only is dropped and counted instead (one warning per
        episode).
        """
        if not entries:
            return []
        ttl = self.settings.results_ttl_s
        with self._lock:
            now = self._clock()
            ids: list[int | None] = [None] * len(entries)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    admitted, evicted_rows, evicted_bytes = self._make_room(entries)
                    for i, entry in enumerate(entries):
                        if not admitted[i]:
                            continue
                        expires = now + ttl if entry.kind == "result" and ttl is not None else None
                        # AUTOINCREMENT: ids are never reused, even after the newest row was deleted.
                        cur = self._db.execute(
                            "INSERT INTO outbox (topic, payload, qos, retain, kind, expires_at) "
                            "VALUES (?, ?, 1, ?, ?, ?)",
                            (
                                entry.topic,
                                sqlite3.Binary(entry.payload),
                                int(entry.retain),
                                _KIND_CODE[entry.kind],
                                expires,
                            ),
                        )
                        ids[i] = cur.lastrowid
                    self._db.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            except sqlite3.Error as exc:
                return self._write_failed(entries, exc, raise_on_failure)
            stored = [e for e, i in zip(entries, ids, strict=True) if i is not None]
            self._n.rows += len(stored) - evicted_rows
            self._n.bytes += sum(e.size for e in stored) - evicted_bytes
            self._n.evicted += evicted_rows
            self._n.dropped_at_cap += len(entries) - len(stored)
            if evicted_rows or len(stored) < len(entries):
                self._episodes.cap_reached()
            self._write_recovered()
        return ids

    def _make_room(self, entries: Sequence[SpoolEntry]) -> tuple[list[bool], int, int]:
        """Apply the cap policy inside the open transaction: (admitted per entry, evicted rows, bytes)."""
        s = self.settings
        new_bytes = sum(e.size for e in entries)
        over_rows = self._n.rows + len(entries) - s.max_rows
        over_bytes = self._n.bytes + new_bytes - s.max_bytes
        admitted = [True] * len(entries)
        if over_rows <= 0 and over_bytes <= 0:
            return admitted, 0, 0
        evicted_rows = evicted_bytes = 0
        if s.results_at_cap == "drop_oldest":
            # Evict a little more than needed (1 % of what is held): at the cap, the next batches then
            # fit without another DELETE each.
            slack = min(10_000, max(1, self._n.rows // 100))
            average = max(1, self._n.bytes // max(1, self._n.rows))
            while over_rows > 0 or over_bytes > 0:
                want = max(over_rows, math.ceil(max(0, over_bytes) / average), 0) + slack
                sizes = [
                    int(r[0]) + ROW_OVERHEAD
                    for r in self._db.execute(
                        "DELETE FROM outbox WHERE id IN "
                        "(SELECT id FROM outbox WHERE kind = 1 AND id > ? ORDER BY id LIMIT ?) "
                        "RETURNING length(payload) + length(topic)",
                        (self._sent_upto, want),
                    )
                ]
                if not sizes:
                    break
                evicted_rows += len(sizes)
                evicted_bytes += sum(sizes)
                over_rows -= len(sizes)
                over_bytes -= sum(sizes)
                slack = 0
        # Still over (drop_newest, or no result left to evict): results that do not fit are refused;
        # job states go in regardless, beyond the cap.
        rows_left = -over_rows
        bytes_left = -over_bytes
        for i in range(len(entries) - 1, -1, -1):  # the batch's own count was already included
            if rows_left >= 0 and bytes_left >= 0:
                break
            if entries[i].kind == "result":
                admitted[i] = False
                rows_left += 1
                bytes_left += entries[i].size
        return admitted, evicted_rows, evicted_bytes

    def _rollback(self) -> None:
        # No transaction may be left to roll back: SQLite rolls back by itself on SQLITE_FULL.
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")

    def _write_failed(
        self, entries: Sequence[SpoolEntry], exc: sqlite3.Error, raise_on_failure: bool
    ) -> list[int | None]:
        """A failed write (lock held): results are dropped and counted; a job state raises."""
        states = sum(1 for e in entries if e.kind == "state")
        if raise_on_failure:
            states = len(entries)  # all of them go elsewhere: none is dropped here
        else:
            self._n.dropped_write_failed += len(entries) - states
        self._n.write_failed_raised += states
        self._episodes.write_failed(
            str(exc),
            hint="durable results are dropped (counted in spool.dropped_write_failed) until the "
            "state directory has free space again",
        )
        if states:
            raise SpoolWriteError(
                f"cannot store {states} message(s) in the spool {self.path}: {exc}; "
                "free disk space in the state directory"
            ) from exc
        return [None] * len(entries)

    def _write_recovered(self) -> None:
        """A write went through: maybe the end of a write-failure episode; deletes that failed are
        tried again."""
        self._episodes.write_succeeded()
        if self._unremoved:
            for message_id in sorted(self._unremoved):
                if not self._delete(message_id):
                    break

    # -- reading and acknowledging ---------------------------------------------------------

    def pending(self, limit: int = 100, after_id: int = 0) -> list[SpooledMessage]:
        """Up to ``limit`` messages with id > ``after_id``, oldest first; expired results are deleted."""
        out: list[SpooledMessage] = []
        with self._lock:
            now = self._clock()
            while len(out) < limit:
                rows = self._db.execute(
                    "SELECT id, topic, payload, qos, retain, expires_at FROM outbox "
                    "WHERE id > ? ORDER BY id LIMIT ?",
                    (after_id, limit - len(out)),
                ).fetchall()
                if not rows:
                    break
                expired = []
                for r in rows:
                    after_id = r[0]
                    if r[0] in self._unremoved:
                        continue
                    if r[5] is not None and r[5] <= now:
                        expired.append(r[0])
                        continue
                    out.append(SpooledMessage(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5]))
                # One transaction per page: after a long outage the replay may meet a million of them.
                self._n.expired += self._delete_many(expired)
            self._episodes.note_level()
        return out

    def mark_sent(self, message_id: int) -> None:
        """Messages up to ``message_id`` are with the MQTT client (in flight): the cap leaves them alone."""
        with self._lock:
            self._sent_upto = max(self._sent_upto, message_id)

    def remove(self, message_id: int) -> None:
        """Forget a message (it was acknowledged, or refused for good). Unknown ids are ignored.

        A delete that fails (full disk) is retried after the next successful write; until then the
        message is not returned by :meth:`pending` (and after a restart it is sent once more).
        """
        with self._lock:
            self._delete(message_id)
            self._episodes.note_level()

    def remove_many(self, message_ids: Sequence[int]) -> None:
        """:meth:`remove` for many in one transaction: one fsync per batch of PUBACKs, not one each."""
        if not message_ids:
            return
        with self._lock:
            self._delete_many(message_ids)
            self._episodes.note_level()

    def _delete_many(self, message_ids: Sequence[int]) -> int:
        """Delete rows in one transaction (lock held); the number of rows deleted."""
        if not message_ids:
            return 0
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                sizes = [
                    int(r[0]) + ROW_OVERHEAD
                    for message_id in message_ids
                    for r in self._db.execute(
                        "DELETE FROM outbox WHERE id = ? RETURNING length(payload) + length(topic)",
                        (message_id,),
                    )
                ]
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        except sqlite3.Error:
            # One by one: what can be deleted is, the rest is remembered and retried.
            return sum(1 for message_id in message_ids if self._delete(message_id))
        self._unremoved.difference_update(message_ids)
        self._n.rows -= len(sizes)
        self._n.bytes -= sum(sizes)
        return len(sizes)

    def _delete(self, message_id: int) -> bool:
        """Delete one row (lock held); False when the write failed."""
        try:
            row = self._db.execute(
                "DELETE FROM outbox WHERE id = ? RETURNING length(payload) + length(topic)", (message_id,)
            ).fetchone()
        except sqlite3.Error as exc:
            self._unremoved.add(message_id)
            self._episodes.write_failed(str(exc), operation="delete")
            return False
        self._unremoved.discard(message_id)
        if row is not None:
            self._n.rows -= 1
            self._n.bytes -= int(row[0]) + ROW_OVERHEAD
        return True

    def count(self) -> int:
        """Number of messages waiting."""
        with self._lock:
            return self._n.rows - len(self._unremoved)

    def stats(self) -> dict[str, float]:
        """Telemetry: ``rows``, ``bytes``, their caps (``max_rows``, ``max_bytes``: an alert on a spool
        near its cap reads the device's own cap, not a guess), the drop counters, and
        ``write_failing`` (0/1)."""
        with self._lock:
            return self._episodes.stats()

    # -- key/value table -------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        """A value of the key/value table, or None."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        """Set (durably) a value of the key/value table; :class:`SpoolWriteError` when it cannot."""
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
            except sqlite3.Error as exc:
                raise SpoolWriteError(
                    f"cannot write {key} to the spool {self.path}: {exc}; free disk space in the state "
                    "directory"
                ) from exc

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()
                # The episode's figures, once, for the journal (what was dropped, and why).
                log.info(
                    "spool.closed",
                    path=str(self.path),
                    **{k: int(v) for k, v in self._episodes.stats().items()},
                )

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
