"""The controller's engine store: vouched engines by cache key, bounded in count and bytes, LRU.

On disk under ``{state_dir}/engines/``: ``blobs/{sha256}.onnx`` (every file of every engine, content
addressed, written by the upload path of ``fleet rollout start``:
:class:`~agent.fleet.controller.upload.UploadSink`; the controller's chunk server serves them by SHA-256)
and ``index.json`` (the entries, written atomically: temp file, fsync, rename). An entry is only added
once all its files are here, so a device is never told of an engine it cannot download. Eviction removes
least recently used entries (a download counts as a use) until both bounds hold, then every blob no entry
and no upload in progress refers to. Withdrawn engines (key and engine SHA-256) are remembered, bounded,
so the same bad bytes are never taken again, each with a note for the operator (its fingerprint, its
builder, when and why: the drop report's device, stage and reason).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection
from pathlib import Path

import structlog
from pydantic import Field, ValidationError

from agent.fleet.engines.settings import EngineShareSettings
from agent.fsutil import atomic_write_json
from agent.model_base import StrictModel
from agent.protocol.engines import EngineRecord, SignedEngine

log = structlog.get_logger(__name__)

INDEX_FILE = "index.json"
BLOBS_DIR = "blobs"
#: Withdrawn (key, engine SHA-256) pairs remembered.
MAX_WITHDRAWN = 1024
#: Longest fingerprint, builder or reason kept in a withdrawn engine's note (they came from devices).
MAX_NOTE_CHARS = 300


class StoredEngine(StrictModel):
    """One vouched engine and its use."""

    signed: SignedEngine
    record: EngineRecord
    bytes: int = Field(ge=0)
    stored_at: float
    last_used: float
    reuse: int = Field(0, ge=0, description="Downloads by other devices than its builder.")
    #: The model and version its builder's job deployed, as the builder said (not signed, not sent to
    #: devices: the operator's listing only; an entry stored before they were kept has neither).
    model_id: str | None = Field(None, max_length=MAX_NOTE_CHARS)
    version: str | None = Field(None, max_length=MAX_NOTE_CHARS)


class WithdrawnNote(StrictModel):
    """What the operator is told of a withdrawn engine (``fleet engines list``, the console)."""

    key: str
    engine_sha256: str
    fingerprint: str = Field(max_length=MAX_NOTE_CHARS)
    built_by: str = Field(max_length=MAX_NOTE_CHARS)
    reason: str = Field(max_length=MAX_NOTE_CHARS)
    at: float


class _Index(StrictModel):
    engines: dict[str, StoredEngine] = Field(default_factory=dict)
    withdrawn: list[tuple[str, str]] = Field(default_factory=list)
    #: The same engines' notes, bounded alike (an index written before notes existed has none).
    withdrawn_notes: list[WithdrawnNote] = Field(default_factory=list)


class EngineStore:
    """Vouched engines by key (see the module docstring). Thread-safe."""

    def __init__(self, directory: Path, bounds: EngineShareSettings, *, create: bool = True) -> None:
        """``create``: make the directories now; False: at :meth:`create` (the controller's start)."""
        self.directory = Path(directory)
        self.blobs = self.directory / BLOBS_DIR
        self.bounds = bounds
        self._lock = threading.Lock()
        self._index = self._load()
        if create:
            self.create()

    def create(self) -> None:
        """Make the store's directories: at the controller's start, once it holds the prefix (a
        controller refused the lease leaves nothing behind in its state directory)."""
        self.blobs.mkdir(parents=True, exist_ok=True)

    def _load(self) -> _Index:
        path = self.directory / INDEX_FILE
        try:
            return _Index.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return _Index()
        except (OSError, ValidationError) as exc:
            # The engines are a cache: an unreadable index costs builds, never a controller start.
            log.warning("fleet.engines.index_unreadable", path=str(path), error=str(exc)[:300])
            return _Index()

    def _save(self) -> None:
        atomic_write_json(self.directory / INDEX_FILE, self._index.model_dump(mode="json"))

    # -- reading --------------------------------------------------------------------------------------

    def get(self, key: str) -> StoredEngine | None:
        with self._lock:
            return self._index.engines.get(key)

    def entries(self) -> list[StoredEngine]:
        """Every entry, most recently used first."""
        with self._lock:
            return sorted(self._index.engines.values(), key=lambda e: e.last_used, reverse=True)

    def withdrawn(self) -> set[tuple[str, str]]:
        with self._lock:
            return {(key, sha) for key, sha in self._index.withdrawn}

    def withdrawn_notes(self) -> list[WithdrawnNote]:
        """The notes of the withdrawn engines, oldest first."""
        with self._lock:
            return list(self._index.withdrawn_notes)

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / f"{sha256}.onnx"

    def have_blobs(self) -> list[str]:
        """SHA-256s of the complete blobs present."""
        return [p.name.removesuffix(".onnx") for p in self.blobs.glob("*.onnx")]

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.bytes for e in self._index.engines.values())

    # -- changing -------------------------------------------------------------------------------------

    def add(
        self,
        signed: SignedEngine,
        record: EngineRecord,
        *,
        keep_blobs: Collection[str] = (),
        model_id: str | None = None,
        version: str | None = None,
    ) -> list[str]:
        """Store a vouched engine whose blobs are all here (its model and version as its builder named
        them); returns the keys evicted to fit the bounds."""
        missing = [f.name for f in record.files if not self.blob_path(f.sha256).is_file()]
        if missing:
            raise ValueError(f"engine {record.key[:12]}: files {missing} are not uploaded")
        now = time.time()
        entry = StoredEngine(
            signed=signed,
            record=record,
            bytes=sum(f.size for f in record.files),
            stored_at=now,
            last_used=now,
            model_id=model_id,
            version=version,
        )
        with self._lock:
            self._index.engines[record.key] = entry
            evicted = self._evict(protect=record.key)
            self._save()
        self.collect_blobs(keep_blobs)
        log.info("fleet.engines.stored", key=record.key, built_by=record.built_by, evicted=len(evicted))
        return evicted

    def used(self, key: str, device: str) -> None:
        """``device`` downloads ``key``: a use (LRU), and a reuse when it is not the builder."""
        with self._lock:
            entry = self._index.engines.get(key)
            if entry is None:
                return
            reuse = entry.reuse + (0 if device == entry.record.built_by else 1)
            self._index.engines[key] = entry.model_copy(update={"last_used": time.time(), "reuse": reuse})
            self._save()

    def withdraw(self, key: str, reason: str) -> bool:
        """Remove ``key`` and remember its engine as bad; False when it was not stored."""
        with self._lock:
            entry = self._index.engines.pop(key, None)
            if entry is None:
                return False
            sha = str(entry.record.meta.get("engine_sha256") or "")
            self._index.withdrawn.append((key, sha))
            del self._index.withdrawn[:-MAX_WITHDRAWN]
            note = WithdrawnNote(
                key=key,
                engine_sha256=sha,
                fingerprint=entry.record.fingerprint[:MAX_NOTE_CHARS],
                built_by=entry.record.built_by[:MAX_NOTE_CHARS],
                reason=reason[:MAX_NOTE_CHARS],
                at=time.time(),
            )
            self._index.withdrawn_notes.append(note)
            del self._index.withdrawn_notes[:-MAX_WITHDRAWN]
            self._save()
        log.warning("fleet.engines.withdrawn", key=key, built_by=entry.record.built_by, reason=reason[:300])
        return True

    def _evict(self, protect: str) -> list[str]:
        engines = self._index.engines
        evicted: list[str] = []
        total = sum(e.bytes for e in engines.values())
        for key in sorted(engines, key=lambda k: engines[k].last_used):
            if len(engines) <= self.bounds.max_entries and total <= self.bounds.max_bytes:
                break
            if key == protect:
                continue
            total -= engines.pop(key).bytes
            evicted.append(key)
            log.info("fleet.engines.evicted", key=key)
        return evicted

    def collect_blobs(self, keep: Collection[str] = ()) -> int:
        """Remove blobs no entry refers to (nor ``keep``: uploads in progress); returns how many."""
        with self._lock:
            wanted = {f.sha256 for e in self._index.engines.values() for f in e.record.files} | set(keep)
        removed = 0
        for path in self.blobs.glob("*.onnx"):
            if path.name.removesuffix(".onnx") not in wanted:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed
