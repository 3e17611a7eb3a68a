"""The operator-side chunk server: answers devices' chunk requests for the models it knows.

Devices pull (docs/delivery.md): a :class:`~agent.protocol.chunks.ChunkRequest` arrives on
``{prefix}/{device}/up/xfer/req`` with an MQTT 5 response topic and correlation data; the server
publishes each requested chunk to that response topic with user properties ``index`` and
``sha256`` and the request's correlation data. The subscription is an MQTT 5 *shared* one
(``$share/{group}/{prefix}/+/up/xfer/+``): the broker hands every request to exactly one of the
servers in the group, so several servers (``fleet serve`` on two hosts) can share one fleet.

The group name is a secret of the operator side, random unless given: mosquitto's ACL file never
checks a SUBSCRIBE, so a device that knew the name could join the group, and every request the
broker handed to it would be lost (it may not read other devices' requests; docs/protocol.md,
"Broker configuration").

A device can only have chunks sent to itself: a request whose response topic is not
``{prefix}/{same device}/down/xfer/{sha256}`` is refused (with an ACL on ``up/#`` a device cannot
write another device's request topic either). Served bytes are counted per device: not progress
(only the device knows what it has), but what shows ``fleet deploy`` that another server answered.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from pydantic import ValidationError

from agent.errors import TransportError
from agent.fleet.base.untrusted import shown
from agent.fleet.chunks.pace import ServeRate, busy_notice, wait_notice
from agent.fleet.chunks.queue import DEFAULT_MAX_ENTRIES, ChunkQueue, PendingChunks
from agent.fsutil import sha256_file
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.chunks import (
    INDEX_PROPERTY,
    SHA256_PROPERTY,
    TIMEOUT_PROPERTY,
    ChunkNotice,
    ChunkRequest,
    notice_properties,
)
from agent.protocol.topics import Topics, check_level, fleet_filter, parse

if TYPE_CHECKING:
    from agent.protocol.manifest import DeployManifest

log = structlog.get_logger(__name__)

#: How a chunk server's shared-subscription group name starts; a random part follows unless the
#: operator names the group (a name devices cannot guess: they never see it).
GROUP_PREFIX = "edge-agent-chunks"
#: A chunk reply not delivered within this time is dropped by the broker (the device asks again);
#: without it an offline device's persistent session would hoard chunks in the broker.
DEFAULT_REPLY_EXPIRY_S = 120
#: Chunk publishes on the wire to the broker at once (paho's window; the rest wait in paho's queue).
DEFAULT_MAX_INFLIGHT = 20
#: Repo directories are rescanned for an unknown model at most this often, unless one of them changed
#: (a file created, renamed in or removed: an upload into the controller's repository is served at
#: once, not a rescan interval plus the device's chunk timeout later).
_RESCAN_INTERVAL_S = 5.0
#: Largest chunk size accepted from a request for a repo model (the manifest's limit is 1 MiB).
_MAX_REQUEST_CHUNK = 16 * 1024 * 1024

#: Called after each chunk is handed to the broker: (device, model sha256, bytes).
ServedCallback = Callable[[str, str, int], None]
_COUNTERS = (
    "requests",
    "chunks",
    "coalesced",
    "busy",
    "refused",
    "bad_request",
    "unknown_model",
    "bad_index",
    "publish_failed",
    "wait_notices",
    "busy_notices",
)
#: Longest a chunk waits for the broker to acknowledge earlier ones before it is published anyway.
_FLOW_WAIT_S = 10.0


@dataclass
class _Model:
    path: Path
    size: int
    fd: int
    chunk_size: int | None = None  # None: a repo file without a manifest; the request says
    chunks: tuple[str, ...] = ()


def random_group(prefix: str = GROUP_PREFIX) -> str:
    """A shared-subscription group name no device can guess (128 random bits)."""
    return f"{prefix}-{secrets.token_hex(16)}"


class ChunkServer:
    """Serve model chunks to devices over MQTT (``start`` / ``stop``).

    Models are known by SHA-256 through :meth:`register` (a manifest and its file) or
    :meth:`add_repo` (every file in a directory, hashed). Requests are checked on the client's
    dispatcher thread and queued (:class:`~agent.fleet.chunks.queue.ChunkQueue`: a request for chunks
    still waiting merges into them); one sender thread publishes what waits, first come first served.
    """

    def __init__(
        self,
        settings: MqttSettings,
        *,
        group: str | None = None,
        client_id: str | None = None,
        reply_expiry_s: int = DEFAULT_REPLY_EXPIRY_S,
        max_unacked: int = 256,
        on_served: ServedCallback | None = None,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        max_waiting: int = DEFAULT_MAX_ENTRIES,
        pace: bool = True,
    ) -> None:
        """``group``: the shared-subscription group (None: a random one, answered by this server only).

        ``max_unacked``: stop answering while this many chunk publishes wait for a PUBACK.

        ``max_inflight``: of those, how many paho keeps on the wire (the rest wait in its queue).

        ``max_waiting``: most (device, model) entries waiting to be sent; a request beyond is dropped
        (counted ``busy``; the device asks again after its timeout).

        ``pace`` False: no notices (a server from before pacing; a comparison needs one).
        """
        self.settings = settings
        self.prefix = settings.prefix
        self.group = check_level(group or random_group(), "shared subscription group")
        self.reply_expiry_s = reply_expiry_s
        self.max_unacked = max_unacked
        self._on_served = on_served
        self._pace = pace
        self._models: dict[str, _Model] = {}
        self._repos: list[Path] = []
        self._repo_index: dict[Path, tuple[float, int, str]] = {}  # path -> (mtime, size, sha256)
        self._last_scan = 0.0
        self._repo_mtimes: dict[Path, int] = {}  # repo -> its directory's st_mtime_ns at the last scan
        self._lock = threading.Lock()
        self._served: collections.Counter[str] = collections.Counter()
        self._served_model: collections.Counter[tuple[str, str]] = collections.Counter()
        self._counts: collections.Counter[str] = collections.Counter(dict.fromkeys(_COUNTERS, 0))
        self._queue = ChunkQueue(max_waiting)
        self._rate = ServeRate()  # under _lock: sampled by the sender, read by the dispatcher
        self._sending_left = 0  # under _lock: chunks of the entry being sent not sent yet
        self._stopping = threading.Event()
        self._sender: threading.Thread | None = None
        self._client = ServiceClient(
            settings, client_id=client_id, handler=self._on_request, max_inflight=max_inflight
        )

    @property
    def topic_filter(self) -> str:
        """The shared subscription: ``$share/{group}/{prefix}/+/up/xfer/+``."""
        return f"$share/{self.group}/{fleet_filter(self.prefix, 'xfer')}"

    # -- models ----------------------------------------------------------------------------------

    def register(self, manifest: DeployManifest, model_path: Path, *, verify: bool = True) -> None:
        """Serve ``model_path`` as the model ``manifest`` describes.

        ``verify``: hash the file first and raise ValueError if it is not the manifest's model
        (serving it would only make every device reject every chunk).
        """
        path = Path(model_path)
        size = path.stat().st_size
        if size != manifest.size:
            raise ValueError(f"{path} has {size} bytes, the manifest says {manifest.size}")
        if verify:
            actual = sha256_file(path)
            if actual != manifest.sha256:
                raise ValueError(f"{path} has SHA-256 {actual}, the manifest says {manifest.sha256}")
        fd = os.open(path, os.O_RDONLY)
        with self._lock:
            old = self._models.pop(manifest.sha256, None)
            self._models[manifest.sha256] = _Model(
                path, size, fd, manifest.chunk_size, tuple(manifest.chunks)
            )
        if old is not None:
            os.close(old.fd)
        log.info("fleet.chunks.registered", sha256=manifest.sha256, path=str(path), size=size)

    def add_repo(self, repo: Path) -> int:
        """Serve every regular file under ``repo``; returns how many there are.

        Files are hashed now; the directory is scanned again (at most every few seconds) when a
        device asks for a model not found yet.
        """
        repo = Path(repo)
        if not repo.is_dir():
            raise ValueError(f"model repository {repo} is not a directory")
        with self._lock:
            self._repos.append(repo)
        return self._scan(force=True)

    def _repos_changed(self) -> bool:
        """Whether a repo directory's own mtime moved since the last scan: one stat per repo, so a
        device asking for unknown models again and again costs no walk of the directories."""
        for repo in list(self._repos):
            try:
                mtime = repo.stat().st_mtime_ns
            except OSError:
                continue
            if self._repo_mtimes.get(repo) != mtime:
                return True
        return False

    def _scan(self, *, force: bool = False) -> int:
        now = time.monotonic()
        if not force and now - self._last_scan < _RESCAN_INTERVAL_S and not self._repos_changed():
            return 0
        self._last_scan = now
        found = 0
        for repo in list(self._repos):
            # Read before the walk: a file arriving during it changes the mtime again (scanned next time).
            with contextlib.suppress(OSError):
                self._repo_mtimes[repo] = repo.stat().st_mtime_ns
            for path in sorted(repo.rglob("*")):
                if not path.is_file() or path.name.startswith("."):
                    continue
                stat = path.stat()
                cached = self._repo_index.get(path)
                if cached is None or cached[:2] != (stat.st_mtime, stat.st_size):
                    cached = (stat.st_mtime, stat.st_size, sha256_file(path))
                    self._repo_index[path] = cached
                sha = cached[2]
                found += 1
                with self._lock:
                    if sha in self._models:
                        continue
                    self._models[sha] = _Model(path, stat.st_size, os.open(path, os.O_RDONLY))
        return found

    def _model(self, sha256: str) -> _Model | None:
        with self._lock:
            model = self._models.get(sha256)
        if model is None and self._repos:
            self._scan()
            with self._lock:
                model = self._models.get(sha256)
        return model

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> ChunkServer:
        """Connect and subscribe; raise TransportError if the broker is unreachable or refuses."""
        self._client.start(timeout)
        self._sender = threading.Thread(target=self._run_sender, name="chunk-sender", daemon=True)
        self._sender.start()
        self._client.subscribe(self.topic_filter, qos=1, timeout=timeout)
        log.info("fleet.chunks.serving", filter=self.topic_filter, models=len(self._models))
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sending, wait (bounded) for outstanding chunk publishes, disconnect, close the model files.

        Chunks still waiting are dropped: their devices ask again (another server, or this one restarted).
        """
        self._stopping.set()
        self._queue.close()
        if self._sender is not None:
            self._sender.join(timeout)
        self._client.wait_published(timeout)
        self._client.stop()
        log.info("fleet.chunks.stopped", **self.stats())
        with self._lock:
            models, self._models = list(self._models.values()), {}
        for model in models:
            os.close(model.fd)

    def __enter__(self) -> ChunkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- accounting ------------------------------------------------------------------------------

    def served_bytes(self, device: str | None = None, sha256: str | None = None) -> int:
        """Chunk bytes published (to ``device``, of model ``sha256``; None: all)."""
        with self._lock:
            if sha256 is not None:
                if device is not None:
                    return self._served_model[(device, sha256)]
                return sum(n for (_, sha), n in self._served_model.items() if sha == sha256)
            if device is not None:
                return self._served[device]
            return sum(self._served.values())

    def stats(self) -> dict[str, int]:
        """Counters: requests, chunks, refused (wrong response topic), bad_request, unknown_model, ..."""
        with self._lock:
            out = dict(self._counts)
        out["served_bytes"] = self.served_bytes()
        out["waiting_chunks"] = self._queue.waiting_chunks
        out.update({f"mqtt_{k}": v for k, v in self._client.stats().items()})
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # -- serving ---------------------------------------------------------------------------------

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        """What to publish for requested chunk ``index`` whose bytes are ``data``: ``[(index, data)]``.

        A seam for fault-injection tests (a subclass corrupts, drops, duplicates or mis-numbers
        replies); a real server never overrides it.
        """
        return [(index, data)]

    def _on_request(self, message: InboundMessage) -> None:
        # Device text goes into the log lines through shown(): `fleet serve -v` prints them on a console.
        try:
            topic = parse(message.topic, self.prefix)
        except ValueError:
            self._count("bad_request")
            return
        if topic.direction != "up" or topic.kind != "xfer":
            self._count("bad_request")
            return
        device = topic.device
        try:
            request = ChunkRequest.model_validate_json(message.payload)
        except ValidationError as exc:
            self._count("bad_request")
            log.warning("fleet.chunks.bad_request", device=shown(device), error=shown(str(exc), 200))
            return
        reply_topic = Topics(self.prefix, device).xfer(request.sha256)
        if message.response_topic != reply_topic or request.device not in (None, device):
            self._count("refused")
            log.warning(
                "fleet.chunks.refused",
                device=shown(device),
                response_topic=shown(message.response_topic or ""),
                claimed_device=shown(request.device or ""),
                why="a device may only ask for chunks sent to its own down/xfer topic",
            )
            return
        model = self._model(request.sha256)
        if model is None:
            self._count("unknown_model")
            log.warning("fleet.chunks.unknown_model", device=shown(device), sha256=shown(request.sha256))
            return
        # The device's manifest decides the chunking (the same file may be deployed with several).
        chunk_size = request.chunk_size or model.chunk_size
        if chunk_size is None or chunk_size > _MAX_REQUEST_CHUNK:
            self._count("bad_request")
            log.warning(
                "fleet.chunks.bad_chunk_size",
                device=shown(device),
                requested=request.chunk_size,
                served=chunk_size,
            )
            return
        self._count("requests")
        indices = []
        for index in request.indices:
            if 0 <= index * chunk_size < model.size:
                indices.append(index)
            else:
                self._count("bad_index")
        if not indices:
            return
        added = self._queue.add(
            device=device,
            sha256=request.sha256,
            chunk_size=chunk_size,
            correlation=message.correlation_data,
            indices=indices,
        )
        timeout_ms = _device_timeout_ms(message) if self._pace else None
        if added is None:
            self._count("busy")
            log.warning("fleet.chunks.busy", device=shown(device), waiting=self._queue.max_entries)
            if timeout_ms is not None:
                refusal = busy_notice(waiting=self._queue.waiting_chunks, per_second=self._per_second())
                self._notify(reply_topic, message.correlation_data, refusal, "busy_notices")
            return
        self._count("coalesced", len(indices) - added)
        if timeout_ms is not None:
            ahead, own = self._queue.ahead(device=device, sha256=request.sha256, chunk_size=chunk_size)
            sent, acked = self._client.delivery_counts()
            with self._lock:
                # The rest of the entry being sent, and what waits for the broker's acknowledgement,
                # are ahead of this request too.
                ahead += self._sending_left + sent - acked
                per_second = self._rate.per_second
            notice = wait_notice(ahead=ahead, own=own, per_second=per_second, timeout_ms=timeout_ms)
            if notice is not None:
                self._notify(reply_topic, message.correlation_data, notice, "wait_notices")

    def _per_second(self) -> float | None:
        with self._lock:
            return self._rate.per_second

    def _notify(self, topic: str, correlation: bytes | None, notice: ChunkNotice, counter: str) -> None:
        """Tell a device about its request (a reply without a chunk: only user properties).

        QoS 1, as the chunks: the client's count of unacknowledged publishes (flow control, the
        chunks ahead of a request) only adds up when every publish is acknowledged.
        """
        properties = PublishProperties(
            correlation_data=correlation,
            user_properties=notice_properties(notice),
            message_expiry_s=self.reply_expiry_s,
        )
        try:
            self._client.publish(topic, b"", qos=1, properties=properties)
        except TransportError as exc:
            log.warning("fleet.chunks.notice_failed", topic=topic, error=str(exc))
            return
        self._count(counter)

    def _run_sender(self) -> None:
        while not self._stopping.is_set():
            entry = self._queue.take(timeout=0.5)
            if entry is None:
                continue
            with self._lock:
                self._sending_left = len(entry.indices)
            try:
                self._serve(entry)
            except Exception:
                # One entry's failure (a file replaced under us) must not end the one thread that
                # serves every device; the device asks again.
                self._count("publish_failed")
                log.exception("fleet.chunks.serve_failed", device=shown(entry.device), sha256=entry.sha256)
            finally:
                with self._lock:
                    self._sending_left = 0

    def _serve(self, entry: PendingChunks) -> None:
        model = self._model(entry.sha256)
        if model is None:
            return  # gone since the request was queued; the device asks again and is told nothing
        hashes = model.chunks if entry.chunk_size == model.chunk_size else ()
        reply_topic = Topics(self.prefix, entry.device).xfer(entry.sha256)  # checked in _on_request
        for index in entry.indices:
            if self._stopping.is_set():
                return
            with self._lock:
                self._sending_left -= 1
            offset = index * entry.chunk_size
            data = os.pread(model.fd, min(entry.chunk_size, model.size - offset), offset)
            for reply_index, payload in self.replies(index, data):
                known = payload is data and reply_index == index and index < len(hashes)
                chunk_hash = hashes[index] if known else hashlib.sha256(payload).hexdigest()
                properties = PublishProperties(
                    correlation_data=entry.correlation,
                    user_properties=((INDEX_PROPERTY, str(reply_index)), (SHA256_PROPERTY, chunk_hash)),
                    message_expiry_s=self.reply_expiry_s,
                )
                self._send(entry.device, entry.sha256, reply_topic, payload, properties)

    def _send(
        self, device: str, sha256: str, topic: str, payload: bytes, properties: PublishProperties
    ) -> None:
        # Flow control: a device asking faster than the broker takes chunks must not grow our memory.
        # Bounded (acknowledgements lost with a connection never come), and cut short by stop().
        deadline = time.monotonic() + _FLOW_WAIT_S
        while not self._client.wait_published(0.25, at_most=self.max_unacked):
            if self._stopping.is_set() or time.monotonic() >= deadline:
                break
        try:
            self._client.publish(topic, payload, qos=1, properties=properties)
        except TransportError as exc:
            self._count("publish_failed")
            log.error("fleet.chunks.publish_failed", device=device, sha256=sha256, error=str(exc))
            return
        _sent, acked = self._client.delivery_counts()
        with self._lock:
            self._rate.sample(time.monotonic(), acked)
            self._counts["chunks"] += 1
            self._served[device] += len(payload)
            self._served_model[(device, sha256)] += len(payload)
        if self._on_served is not None:
            self._on_served(device, sha256, len(payload))


def _device_timeout_ms(message: InboundMessage) -> int | None:
    """The re-request timeout a request names (a device that understands notices), else None."""
    for key, value in message.user_properties:
        if key == TIMEOUT_PROPERTY and value.isdigit() and len(value) <= 9:
            return int(value)
    return None
