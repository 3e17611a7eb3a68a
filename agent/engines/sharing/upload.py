"""Offering an engine to the controller: its files described for a chunked pull, the offer, and the
upload of the files the controller wants in pieces (the upload path of ``fleet rollout start``).
Used by :class:`agent.engines.sharing.cache.FleetEngineCache` once the trust rules let it offer."""

from __future__ import annotations

import time
from pathlib import Path

import structlog

from agent.engines.cache.key import SIDECAR_NAME
from agent.engines.cache.store import LAST_USED_NAME, CacheEntry
from agent.engines.sharing.link import EngineRequests
from agent.fsutil import hash_chunks
from agent.protocol.engines import MAX_ENGINE_FILES, EngineFile, EngineOffer

log = structlog.get_logger(__name__)

#: Chunk size the offered files are described with (the controller's chunk server serves them so).
OFFER_CHUNK_BYTES = 256 * 1024
#: Bytes per upload piece (well under a broker's packet limit).
PIECE_BYTES = 256 * 1024
#: How often, and how long apart, an offer the controller cannot match to an ACTIVE job yet is repeated.
_ACTIVE_WAITS = 30
_ACTIVE_WAIT_S = 1.0


def offer_and_upload(
    requests: EngineRequests, entry: CacheEntry, offer: EngineOffer, timeout_s: float
) -> str:
    """Offer ``offer``, upload the files the controller wants, offer again to commit; what happened."""
    rounds = 0
    waits = 0
    while rounds < 2:  # offer, upload what is wanted, offer again to commit
        reply = requests.request("offer", offer, timeout_s)
        if reply is None:
            return "no_answer"
        if not reply.ok and (reply.error or "").startswith("not_active") and waits < _ACTIVE_WAITS:
            # The offer overtook the job's ACTIVE status on its way to the controller.
            waits += 1
            time.sleep(_ACTIVE_WAIT_S)
            continue
        rounds += 1
        if not reply.ok:
            return f"refused: {reply.error_code}: {(reply.error or '')[:200]}"
        result = reply.result or {}
        if result.get("stored"):
            return "stored"
        wanted = {str(sha) for sha in result.get("want") or ()}
        for file in offer.files:
            if file.sha256 in wanted and not _upload(requests, entry.file(file.name), file, timeout_s):
                return "upload_failed"
    return "not_stored"


def _upload(requests: EngineRequests, path: Path, file: EngineFile, timeout_s: float) -> bool:
    with open(path, "rb") as handle:
        offset = 0
        while offset < file.size:
            data = handle.read(PIECE_BYTES)
            if not data:
                return False
            properties = {"sha256": file.sha256, "offset": str(offset), "size": str(file.size)}
            reply = requests.request("piece", data, timeout_s, properties)
            if reply is None or not reply.ok:
                log.warning(
                    "engine.fleet.piece_refused",
                    sha256=file.sha256,
                    offset=offset,
                    error=None if reply is None else reply.error,
                )
                return False
            offset += len(data)
    return True


def describe_entry(entry: CacheEntry) -> list[EngineFile] | None:
    """Every file of the entry (not its sidecar or LRU marker), described for a chunked pull; None when
    the entry holds a directory (an ONNX Runtime TensorRT engine cache) or too many files."""
    files: list[EngineFile] = []
    for path in sorted(entry.directory.iterdir()):
        if path.name in (SIDECAR_NAME, LAST_USED_NAME):
            continue
        if not path.is_file() or path.stat().st_size == 0:
            return None
        files.append(describe_file(path))
    return files if 0 < len(files) <= MAX_ENGINE_FILES else None


def describe_file(path: Path) -> EngineFile:
    size, whole, chunks = hash_chunks(path, OFFER_CHUNK_BYTES)
    return EngineFile(name=path.name, size=size, sha256=whole, chunk_size=OFFER_CHUNK_BYTES, chunks=chunks)
