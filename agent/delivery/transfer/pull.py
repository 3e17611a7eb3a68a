"""Getting the model bytes: the device-side MQTT chunk pull, and :func:`fetch_model` over all sources.

Why the device pulls (docs/delivery.md): QoS 1 is acknowledged hop by hop, so chunks pushed at a
device are lost silently when the broker's queue for it overflows. The device instead keeps a
*window* of chunk requests outstanding on ``up/xfer/req``; the chunk server answers each index on
the request's MQTT 5 response topic ``down/xfer/{sha256}`` with user properties ``index`` and
``sha256``. Every chunk is verified against the manifest before it is written; a timeout, a corrupt
chunk or a reconnect simply asks again. The window also bounds the loss on a crash: chunks written
but not yet recorded on disk occupy window slots until they are flushed, so a killed agent
fetches at most one window again. Flushes run on the partial download's flusher thread, half a
window at a time, so the other half keeps the link busy meanwhile.

A little over 400 lines: the pull's window, timeouts (agent/delivery/transfer/rto.py decides their length),
reconnect handling and reply checks share its state; ``fetch_model``'s source order is the rest.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.http_source import HttpSource
from agent.delivery.transfer.partial import PartialDownload
from agent.delivery.transfer.replies import ChunkReply, ReplyQueue, router_for
from agent.delivery.transfer.rto import RetransmitTimer, due_after_wait, resume_after_busy
from agent.errors import DeliveryError
from agent.mqtt.core import PublishProperties
from agent.protocol.chunks import (
    INDEX_PROPERTY,
    SHA256_PROPERTY,
    TIMEOUT_PROPERTY,
    ChunkNotice,
    ChunkRequest,
    read_notice,
)
from agent.protocol.delivery_errors import JobCancelledError, NoSourceError, TransferTimeoutError
from agent.protocol.topics import Topics

if TYPE_CHECKING:
    from agent.mqtt.link import MqttLink
    from agent.protocol.manifest import DeployManifest

log = structlog.get_logger(__name__)

#: Re-request timeouts double per attempt, up to this multiple of ``chunk_timeout_s``.
_MAX_BACKOFF_FACTOR = 16
#: Request send times kept for round-trip samples (older requests' replies give none).
_ASKED_KEPT = 1024
#: Longest single wait of the pull loop (so cancel, reconnects and the deadline are seen promptly).
_TICK_S = 0.2
#: Longest a written chunk waits for the rest of its batch before it is flushed anyway.
_FLUSH_DELAY_S = 0.25

Progress = Callable[[int, int], None]


@dataclass
class PullStats:
    """What one pull did; ``refetched_bytes`` only counts chunks requested more than once."""

    requests: int = 0
    requested_chunks: int = 0
    requested_bytes: int = 0
    refetched_bytes: int = 0
    received: int = 0
    written: int = 0
    corrupt: int = 0
    duplicate: int = 0
    out_of_range: int = 0
    malformed: int = 0
    timeouts: int = 0
    reconnect_rerequests: int = 0
    dropped_overflow: int = 0
    flushes: int = 0
    #: What those flushes took in all, in ms (the data's sync and the record's): the time written
    #: chunks held their window slots waiting to become durable.
    flush_ms: int = 0
    #: Most chunks at risk at once (requested and unanswered, or written and not yet durable),
    #: seen when requesting; the window bounds it.
    max_at_risk: int = 0
    #: Chunks requested while a background flush was running (the window kept busy meanwhile).
    requested_while_flushing: int = 0
    #: The re-request timeout the round trips measured so far give (agent/delivery/transfer/rto.py), in ms.
    timeout_ms: int = 0
    #: The server's word (docs/delivery.md, "Pacing"): notices that the chunks wait in its line, the
    #: longest wait one named (ms), and notices that it was too busy to queue a request.
    wait_notices: int = 0
    server_wait_ms: int = 0
    busy_notices: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (telemetry, job status details)."""
        return asdict(self)


# -- the pull ----------------------------------------------------------------------------------------


@dataclass
class _Outstanding:
    due: float  # monotonic time after which the chunk is asked for again


class MqttPull:
    """Pull the missing chunks of ``partial`` over MQTT, with a window, timeouts and backoff.

    Call :meth:`run` on the thread that owns ``partial``. Raises JobCancelledError when ``cancel`` is set,
    TransferTimeoutError at ``deadline`` (monotonic; default now + ``config.job_deadline_s``).
    """

    def __init__(
        self,
        manifest: DeployManifest,
        partial: PartialDownload,
        *,
        link: MqttLink,
        topics: Topics,
        config: DeliveryConfig,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
        stall_s: float | None = None,
    ) -> None:
        self.manifest = manifest
        self.partial = partial
        self.link = link
        self.topics = topics
        self.config = config
        self.window = config.chunk_window
        self._progress = progress
        self._cancel = cancel or threading.Event()
        self._deadline = deadline if deadline is not None else time.monotonic() + config.job_deadline_s
        #: Give up once no chunk arrived for this long (None: only the deadline ends a pull).
        self._stall_s = stall_s
        self._last_chunk = time.monotonic()
        self.stats = PullStats()
        self._id = uuid.uuid4().hex[:12]
        self._seq = 0
        self._outstanding: dict[int, _Outstanding] = {}
        #: Waits longer before asking again when answers are slow (at fleet scale), never shorter.
        self.timer = RetransmitTimer(floor_s=config.chunk_timeout_s)
        # request sequence number -> when it was sent, and the chunks it asked for
        self._asked_at: dict[int, tuple[float, list[int]]] = {}
        self._hold_until = 0.0  # a busy server said: no request before this (monotonic)
        self._rng = random.Random()
        self._attempts: collections.Counter[int] = collections.Counter()
        self._retry: collections.deque[int] = collections.deque()
        self._todo: collections.deque[int] = collections.deque()
        self._flush_due: float | None = None
        self._durable = threading.Event()  # set by the flusher thread: window slots were freed
        self._reported = partial.bytes_done
        #: No chunk is asked again before this (monotonic): the last reply's time plus the timeout.
        self._progress_due = 0.0
        #: What every request's correlation data starts with; the request's number follows.
        self._correlation_head = f"{self._id}:".encode()

    def run(self) -> None:
        """Pull until every chunk is written and flushed (progress is flushed on any exit)."""
        if self.partial.complete:
            return
        router = router_for(self.link, self.topics)
        # Room for every reply of a full window twice over (duplicates); overflow is asked again.
        replies = router.attach(self.manifest.sha256, maxsize=4 * self.window + 16)

        def wake() -> None:  # on the flusher thread: chunks became durable, window slots are free
            self._durable.set()
            replies.wake()

        self.partial.on_durable = wake
        started = time.monotonic()
        log.info(
            "delivery.pull.started",
            sha256=self.manifest.sha256,
            missing=len(self.partial.missing()),
            chunks=self.partial.chunk_count,
            window=self.window,
        )
        try:
            self._loop(replies)
        finally:
            router.detach(self.manifest.sha256)
            self.partial.on_durable = None
            self.partial.flush()
            self.stats.dropped_overflow = router.overflow
            self.stats.flushes = self.partial.flushes
            self.stats.flush_ms = round(self.partial.flush_s * 1000)
        log.info(
            "delivery.pull.done",
            sha256=self.manifest.sha256,
            seconds=round(time.monotonic() - started, 3),
            **self.stats.as_dict(),
        )

    def _loop(self, replies: ReplyQueue) -> None:
        partial = self.partial
        self._todo.extend(partial.missing())
        session = self.link.session
        while not partial.complete:
            now = time.monotonic()
            if self._cancel.is_set():
                raise JobCancelledError(f"transfer of model {self.manifest.sha256} cancelled")
            if now >= self._deadline:
                raise TransferTimeoutError(self._timeout_message())
            if self._stall_s is not None and now - self._last_chunk >= self._stall_s:
                raise TransferTimeoutError(
                    f"model {self.manifest.sha256}: no chunk arrived in {self._stall_s:g}s "
                    f"({len(self.partial.missing())} of {self.partial.chunk_count} missing): no server has it"
                )
            partial.raise_flush_error()
            if self.link.connected and self.link.session != session:
                # Reconnected: replies in flight on the old connection are likely gone; ask again now.
                session = self.link.session
                self._requeue_outstanding()
            # Replies that queued up while this thread was busy (a loaded device) count before any
            # timeout fires: asking again for a chunk waiting in our own queue is asking twice.
            if self._take_arrived(replies):
                break  # complete
            now = time.monotonic()
            self._expire(now)
            # Written chunks are flushed in batches (PartialDownload.flush_every, by the flusher
            # thread); what is left over is flushed when nothing else is on its way, or after
            # _FLUSH_DELAY_S, so a straggler does not hold the rest.
            if self._flush_due is not None and (not self._outstanding or now >= self._flush_due):
                self._flush_due = None
                partial.request_flush()
            if self.link.connected:
                self._durable.clear()
                self._request(now)
            wakes = [self._deadline, now + _TICK_S]
            if self._outstanding:
                wakes.append(max(self._progress_due, min(o.due for o in self._outstanding.values())))
            if self._hold_until > now:
                wakes.append(self._hold_until)
            if self._stall_s is not None:
                wakes.append(self._last_chunk + self._stall_s)
            if self._flush_due is not None:
                wakes.append(self._flush_due)
            try:
                self._on_reply(replies.get(timeout=max(0.0, min(wakes) - now)))
            except queue.Empty:
                continue
            self._report_progress()

    def _take_arrived(self, replies: ReplyQueue) -> bool:
        """Process every reply already queued, without waiting; True when the download is complete."""
        while True:
            if self._durable.is_set() and self.link.connected:
                # Slots were freed: ask now rather than after the replies queued meanwhile
                # (processing those takes a while; the server should not idle until then).
                self._durable.clear()
                self._request(time.monotonic())
            try:
                self._on_reply(replies.get_nowait())
            except queue.Empty:
                return self.partial.complete
            self._report_progress()

    def _report_progress(self) -> None:
        """Tell the job the bytes written so far, after every reply: on a busy device many replies
        queue up and are taken in one go, and a report only after them all would jump from nothing to
        everything (the job publishes each tenth it crosses; ``fleet deploy`` reads its first tenth as
        where the download started, to tell bytes another chunk server sent)."""
        done = self.partial.bytes_done
        if self._progress is not None and done != self._reported:
            self._reported = done
            self._progress(done, self.manifest.size)

    def _timeout_message(self) -> str:
        missing = len(self.partial.missing())
        return (
            f"model {self.manifest.sha256}: {missing} of {self.partial.chunk_count} chunks still "
            f"missing after delivery.job_deadline_s={self.config.job_deadline_s}s "
            f"({self.stats.timeouts} request timeouts); check that a chunk server (`edge-agent fleet "
            "serve` or `fleet deploy`) runs for this model, then publish the manifest again "
            "(downloaded chunks are kept)"
        )

    def _requeue_outstanding(self) -> None:
        lost = sorted(self._outstanding)
        self._outstanding.clear()
        self._retry.extendleft(reversed(lost))
        self.stats.reconnect_rerequests += len(lost)

    def _expire(self, now: float) -> None:
        if now < self._progress_due:
            return  # replies are flowing: what is outstanding is most likely on its way
        expired = sorted(i for i, o in self._outstanding.items() if now >= o.due)
        for index in expired:
            del self._outstanding[index]
            self._retry.append(index)
        self.stats.timeouts += len(expired)

    def _next_wanted(self) -> int | None:
        for source in (self._retry, self._todo):
            while source:
                index = source.popleft()
                if not self.partial.has(index) and index not in self._outstanding:
                    return index
        return None

    def _request(self, now: float) -> None:
        if now < self._hold_until:
            return
        # Unflushed chunks count against the window: they are what a crash would lose.
        free = self.window - len(self._outstanding) - self.partial.unflushed
        indices: list[int] = []
        while len(indices) < free:
            index = self._next_wanted()
            if index is None:
                break
            indices.append(index)
        if not indices:
            return
        base = self.timer.timeout
        for index in indices:
            factor = min(2 ** self._attempts[index], _MAX_BACKOFF_FACTOR)
            if self._attempts[index]:
                self.stats.refetched_bytes += self.partial.chunk_length(index)
            self._attempts[index] += 1
            self._outstanding[index] = _Outstanding(due=now + base * factor)
            self.stats.requested_bytes += self.partial.chunk_length(index)
        self._seq += 1
        self._asked_at[self._seq] = (now, indices)
        if len(self._asked_at) > _ASKED_KEPT:
            del self._asked_at[next(iter(self._asked_at))]
        request = ChunkRequest(
            sha256=self.manifest.sha256,
            indices=indices,
            chunk_size=self.manifest.chunk_size,
            device=self.topics.device_id,
        )
        properties = PublishProperties(
            response_topic=self.topics.xfer(self.manifest.sha256),
            correlation_data=self._correlation_head + str(self._seq).encode(),
            # Asks the server for notices when the chunks will wait about this long or more.
            user_properties=((TIMEOUT_PROPERTY, str(round(base * 1000))),),
        )
        self.link.publish(
            self.topics.xfer_req, request.model_dump_json().encode(), qos=1, properties=properties
        )
        self.stats.requests += 1
        self.stats.requested_chunks += len(indices)
        self.stats.max_at_risk = max(self.stats.max_at_risk, len(self._outstanding) + self.partial.unflushed)
        if self.partial.flushing:
            self.stats.requested_while_flushing += len(indices)

    def _request_seq(self, correlation: bytes | None) -> int:
        """The sequence number of this pull's request a reply answers (-1: not one of this pull's)."""
        head = self._correlation_head
        if not correlation or not correlation.startswith(head):
            return -1
        seq = correlation[len(head) :]
        return int(seq) if seq.isdigit() else -1

    def _on_reply(self, reply: ChunkReply | None) -> None:
        if reply is None:
            return  # a wake-up: a flush ended
        message = reply.message
        self.stats.received += 1
        index_text = claimed = None
        for key, value in message.user_properties:
            if key == INDEX_PROPERTY:
                index_text = value
            elif key == SHA256_PROPERTY:
                claimed = value
        if index_text is None:
            notice = read_notice(dict(message.user_properties))
            if notice is not None:
                self._on_notice(notice, self._request_seq(message.correlation_data))
            else:
                self.stats.malformed += 1
            return
        try:
            index = int(index_text)
        except ValueError:
            self.stats.malformed += 1
            return
        partial = self.partial
        if not 0 <= index < partial.chunk_count:
            self.stats.out_of_range += 1
            partial.rejected["out_of_range"] += 1
            return
        if partial.has(index):
            self.stats.duplicate += 1
            partial.rejected["duplicate"] += 1
            return
        if (claimed is not None and claimed != self.manifest.chunks[index]) or not partial.write_chunk(
            index, message.payload, reply.digest
        ):
            self.stats.corrupt += 1
            log.warning("delivery.pull.chunk_rejected", sha256=self.manifest.sha256, index=index)
            if self._outstanding.pop(index, None) is not None:
                self._retry.appendleft(index)  # ask again at once; the deadline bounds a bad server
            return
        self._outstanding.pop(index, None)
        now = self._last_chunk = time.monotonic()
        asked = self._asked_at.get(self._request_seq(message.correlation_data))
        if asked is not None:
            # The reply names its request (correlation data), so even the answer to a chunk asked
            # for twice gives its true round trip.
            self.timer.sample(now - asked[0])
        timeout = self.timer.timeout
        self.stats.timeout_ms = round(timeout * 1000)
        # Progress restarts the timer of what is still outstanding (TCP's rule, RFC 6298 5.3): replies
        # are flowing, so the rest is most likely on its way behind this one, and asking for it now
        # would only have the server send it twice (at fleet scale it arrives seconds apart).
        self._progress_due = now + timeout
        self.stats.written += 1
        if self._flush_due is None:
            self._flush_due = now + _FLUSH_DELAY_S

    def _on_notice(self, notice: ChunkNotice, seq: int) -> None:
        """The server's word about request ``seq``: wait in its line, or come back later."""
        now = time.monotonic()
        if notice.retry_ms is not None:
            # Busy: nothing of that request was queued. Its chunks go back to the front of the line
            # (not counted as asked again), and no request leaves before the time the server named.
            self.stats.busy_notices += 1
            asked = self._asked_at.get(seq)
            refused = [i for i in (asked[1] if asked else []) if self._outstanding.pop(i, None) is not None]
            for index in refused:
                self._attempts[index] -= 1
            self._retry.extendleft(reversed(refused))
            resume = resume_after_busy(now, notice.retry_ms / 1000, self._rng.random())
            self._hold_until = max(self._hold_until, resume)
        if notice.wait_ms is not None:
            # Queued behind others: what is outstanding is on its way, later than a timeout expects.
            self.stats.wait_notices += 1
            self.stats.server_wait_ms = max(self.stats.server_wait_ms, notice.wait_ms)
            due = due_after_wait(now, notice.wait_ms / 1000, self.timer.timeout)
            for outstanding in self._outstanding.values():
                outstanding.due = max(outstanding.due, due)


# -- all sources ------------------------------------------------------------------------------------


def fetch_model(
    manifest: DeployManifest,
    part_dir: Path,
    progress: Progress,
    cancel: threading.Event,
    *,
    link: MqttLink | None,
    topics: Topics,
    config: DeliveryConfig,
    on_pull: Callable[[PullStats], None] | None = None,
    stall_s: float | None = None,
) -> Path:
    """Download ``manifest``'s model into ``part_dir`` and return the file, every chunk verified.

    The whole file's SHA-256 is not checked here: the caller hashes it where it adopts the file (the
    model store, :func:`~agent.delivery.transfer.engine_fetch.fetch_engine_file`), once.

    Sources are tried in manifest order (mqtt: :class:`MqttPull`; http: :class:`HttpSource`); a
    failing source falls through to the next, keeping the chunks it wrote. Resumes what an earlier
    (killed) attempt left in ``part_dir``. Raises JobCancelledError, TransferTimeoutError (after
    ``config.job_deadline_s``), DiskFullError, or the last source's DeliveryError.
    ``on_pull`` is given each MQTT pull's counters when it ends, however it ends; ``stall_s`` ends an
    MQTT pull that got no chunk for that long (TransferTimeoutError).
    """
    deadline = time.monotonic() + config.job_deadline_s
    # Half a window per flush: one half is made durable by the flusher thread while the other
    # half is on its way, and both together stay within the window a crash may cost. Every chunk is
    # checked here; the whole file is hashed once, by whoever adopts it (FetchFn's contract).
    partial = PartialDownload(
        part_dir,
        manifest,
        flush_every=max(1, config.chunk_window // 2),
        background=True,
        whole_hash=False,
    )
    try:
        progress(partial.bytes_done, manifest.size)
        last_error: DeliveryError | None = None
        for source in manifest.sources:
            if partial.complete:
                break
            try:
                if source.kind == "mqtt":
                    if link is None:
                        raise NoSourceError(
                            "the manifest asks for an MQTT pull but this agent has no MQTT link"
                        )
                    pull = MqttPull(
                        manifest,
                        partial,
                        link=link,
                        topics=topics,
                        config=config,
                        progress=progress,
                        cancel=cancel,
                        deadline=deadline,
                        stall_s=stall_s,
                    )
                    try:
                        pull.run()
                    finally:
                        if on_pull is not None:
                            on_pull(pull.stats)
                elif source.url is not None:
                    HttpSource(
                        source.url, timeout_s=config.http_timeout_s, cancel=cancel, deadline=deadline
                    ).fetch(partial, progress)
            except (JobCancelledError, TransferTimeoutError):
                raise
            except DeliveryError as exc:
                last_error = exc
                log.warning(
                    "delivery.source.failed",
                    sha256=manifest.sha256,
                    source=source.kind,
                    url=source.url,
                    code=exc.code,
                    error=str(exc),
                )
        if not partial.complete:
            raise last_error or NoSourceError(f"manifest for model {manifest.sha256} lists no usable source")
        return partial.finish()
    finally:
        partial.close()
