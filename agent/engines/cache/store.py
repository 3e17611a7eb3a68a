"""The engine cache: ``engines/<key>/{<engine file>, meta.json, last_used}`` under the state dir.

One directory per cache key (:func:`agent.engines.cache.key.engine_cache_key`). An entry is written
into a hidden temporary directory next to it, fsynced, and renamed into place, so a reader sees
either no entry or a complete one, never a torn engine. :meth:`EngineCache.get` checks the sidecar
against the key and the engine file against the size and SHA-256 the sidecar recorded; anything
missing, corrupt or mismatched is logged, removed, and reported as a miss, so the caller rebuilds
instead of crashing.

The cache is size-capped: :meth:`EngineCache.evict` removes the least recently used entries
(``last_used`` is a marker file whose mtime is set on every hit) until the cache fits, never an
entry that is protected (the active and last-known-good engines of every slot).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.engines.cache.key import SIDECAR_NAME, EngineMeta, read_sidecar, write_sidecar
from agent.errors import BuildError
from agent.fsutil import fsync_directory, sha256_file

log = structlog.get_logger(__name__)

#: Marker file whose mtime is the entry's last use (LRU order).
LAST_USED_NAME = "last_used"

#: Prefixes of the cache's own hidden working directories (never entries).
_STAGING_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"

#: Staging or trash directories older than this are left over from a crash and removed.
_STALE_SECONDS = 3600.0

_COPY_BLOCK = 1 << 20


@dataclass(frozen=True)
class CacheEntry:
    """One cached engine: its directory, engine file and sidecar."""

    key: str
    directory: Path
    meta: EngineMeta

    @property
    def engine_path(self) -> Path:
        return self.directory / self.meta.engine_file

    def file(self, name: str) -> Path:
        """Path of another file stored with the engine (calibration table, ...)."""
        return self.directory / name


def _is_key(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _dir_bytes(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(directory: Path) -> None:
    """fsync every file and directory below ``directory`` (bottom-up), so a rename of it is durable."""
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync_file(Path(root) / name)
        fsync_directory(Path(root))


def _place(source: bytes | Path, target: Path, *, move: bool) -> None:
    """Write ``source`` (bytes, a file or a directory) at ``target``; move it when asked and possible."""
    if isinstance(source, bytes):
        target.write_bytes(source)
        return
    source = Path(source)
    if move:
        try:
            os.replace(source, target)
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:  # another file system: copy instead
                raise
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


class EngineCache:
    """Size-capped, crash-safe store of built engines keyed by their cache key. Thread-safe."""

    def __init__(self, root: Path, max_bytes: int, *, verify_hash: bool = True) -> None:
        """``verify_hash``: check the engine's SHA-256 on every hit (reads the whole file once)."""
        if max_bytes <= 0:
            raise ValueError(f"engine cache max_bytes must be > 0, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.verify_hash = verify_hash
        self._lock = threading.RLock()
        self._protected: set[str] = set()
        self._last_stamp = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_work_dirs()

    # -- lookup ------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """Directory an entry with ``key`` lives in (whether or not it exists)."""
        if not _is_key(key):
            raise BuildError(f"engine cache key {key!r} is not a SHA-256 hex digest")
        return self.root / key

    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key``, or None. A corrupt or mismatched entry is removed and is a miss.

        Never raises for the entry's contents; a hit marks the entry as just used.
        """
        directory = self.path_of(key)
        with self._lock:
            if not directory.is_dir():
                return None
            problem = None
            meta = read_sidecar(directory, expected_key=key)
            if meta is None:
                problem = "sidecar missing, unreadable or for another key"
            else:
                problem = self._check_engine(directory, meta)
            if problem is not None or meta is None:
                log.warning("engine.cache.invalid", key=key, reason=problem)
                self._remove_dir(directory)
                return None
            self._touch(directory)
            return CacheEntry(key, directory, meta)

    def _check_engine(self, directory: Path, meta: EngineMeta) -> str | None:
        engine = directory / meta.engine_file
        if Path(meta.engine_file).name != meta.engine_file or meta.engine_file in (
            SIDECAR_NAME,
            LAST_USED_NAME,
        ):
            return f"engine file name {meta.engine_file!r} is not a plain file name"
        try:
            size = engine.stat().st_size
        except OSError as exc:
            return f"engine file unreadable: {exc}"
        if meta.engine_bytes is not None and size != meta.engine_bytes:
            return f"engine file is {size} bytes, the sidecar recorded {meta.engine_bytes} (truncated?)"
        if self.verify_hash and meta.engine_sha256 is not None:
            try:
                digest = sha256_file(engine)
            except OSError as exc:
                return f"engine file unreadable: {exc}"
            if digest != meta.engine_sha256:
                return "engine file SHA-256 differs from the sidecar (corrupted on disk?)"
        return None

    def __contains__(self, key: str) -> bool:
        return self.path_of(key).is_dir()

    def keys(self) -> list[str]:
        """Keys of the entries present (not validated), least recently used first."""
        return [key for key, _used, _size in self._scan()]

    # -- store -------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        engine: bytes | Path,
        meta: EngineMeta,
        *,
        files: Mapping[str, bytes | Path] | None = None,
        move: bool = False,
    ) -> CacheEntry:
        """Store ``engine`` (bytes or a file) with ``meta`` and optional extra ``files`` under ``key``.

        The entry appears atomically (temp dir, fsync, rename) and replaces an existing one. The
        sidecar's ``engine_bytes``/``engine_sha256`` are filled from the stored file. ``move``
        renames source files instead of copying them (they must not be used afterwards). Evicts
        least recently used entries afterwards, never this one or a protected one.
        """
        if meta.key != key:
            raise BuildError(f"engine sidecar is for key {meta.key[:12]}, not {key[:12]}")
        target = self.path_of(key)
        names = [meta.engine_file, *(files or {})]
        for name in names:
            if Path(name).name != name or name in ("", ".", "..", SIDECAR_NAME, LAST_USED_NAME):
                raise BuildError(f"cannot store {name!r} in an engine cache entry: not a plain file name")
        if len(set(names)) != len(names):
            raise BuildError(f"engine cache entry file names repeat: {names}")
        staging = self.root / f"{_STAGING_PREFIX}{key[:16]}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            engine_path = staging / meta.engine_file
            _place(engine, engine_path, move=move)
            for name, source in (files or {}).items():
                _place(source, staging / name, move=move)
            meta = meta.model_copy(
                update={"engine_bytes": engine_path.stat().st_size, "engine_sha256": sha256_file(engine_path)}
            )
            write_sidecar(staging, meta)
            (staging / LAST_USED_NAME).touch()
            _fsync_tree(staging)
            with self._lock:
                self._swap_in(staging, target)
                self._touch(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("engine.cache.stored", key=key, bytes=meta.engine_bytes, path=str(target))
        self.evict(protect={key})
        return CacheEntry(key, target, meta)

    def _swap_in(self, staging: Path, target: Path) -> None:
        trash: Path | None = None
        if target.exists():
            # rename(2) cannot replace a non-empty directory: move the old entry aside first.
            trash = self.root / f"{_TRASH_PREFIX}{target.name[:16]}-{uuid.uuid4().hex[:8]}"
            os.replace(target, trash)
        os.replace(staging, target)
        fsync_directory(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def remove(self, key: str) -> bool:
        """Delete the entry for ``key``; False when there was none."""
        directory = self.path_of(key)
        with self._lock:
            if not directory.exists():
                return False
            self._remove_dir(directory)
            return True

    def _remove_dir(self, directory: Path) -> None:
        # Rename first so a crash mid-delete never leaves a half entry under a valid key.
        trash = self.root / f"{_TRASH_PREFIX}{directory.name[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(directory, trash)
        except OSError as exc:
            log.warning("engine.cache.remove_failed", path=str(directory), error=str(exc))
            return
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(OSError):
            fsync_directory(self.root)

    # -- LRU and size cap --------------------------------------------------------------------

    def _touch(self, directory: Path) -> None:
        # Strictly increasing stamps, so two uses within the clock's resolution still order.
        stamp = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = stamp
        marker = directory / LAST_USED_NAME
        try:
            marker.touch()
            os.utime(marker, ns=(stamp, stamp))
        except OSError as exc:
            log.warning("engine.cache.touch_failed", path=str(marker), error=str(exc))

    def _scan(self) -> list[tuple[str, int, int]]:
        """``(key, last used ns, bytes)`` of every entry directory, least recently used first."""
        found: list[tuple[str, int, int]] = []
        try:
            children = list(self.root.iterdir())
        except OSError:
            return []
        for child in children:
            if not _is_key(child.name) or not child.is_dir():
                continue
            try:
                used = (child / LAST_USED_NAME).stat().st_mtime_ns
            except OSError:
                used = 0  # no marker: treat as oldest
            found.append((child.name, used, _dir_bytes(child)))
        found.sort(key=lambda item: (item[1], item[0]))
        return found

    def total_bytes(self) -> int:
        """Bytes used by all entries."""
        return sum(size for _key, _used, size in self._scan())

    def protect(self, keys: Iterable[str]) -> None:
        """Replace the set of keys eviction must never remove (active and last-known-good engines)."""
        with self._lock:
            self._protected = set(keys)

    @property
    def protected(self) -> frozenset[str]:
        return frozenset(self._protected)

    def evict(self, protect: Iterable[str] = ()) -> list[str]:
        """Remove least recently used entries until the cache fits ``max_bytes``; returns their keys.

        Keys in ``protect`` and those set with :meth:`protect` are never removed, even if the cache
        then stays over its cap (logged as ``engine.cache.over_cap``).
        """
        with self._lock:
            keep = self._protected | set(protect)
            entries = self._scan()
            total = sum(size for _key, _used, size in entries)
            evicted: list[str] = []
            for key, _used, size in entries:
                if total <= self.max_bytes:
                    break
                if key in keep:
                    continue
                self._remove_dir(self.root / key)
                total -= size
                evicted.append(key)
                log.info("engine.cache.evicted", key=key, bytes=size)
            if total > self.max_bytes:
                log.warning(
                    "engine.cache.over_cap", bytes=total, max_bytes=self.max_bytes, protected=len(keep)
                )
            return evicted

    def _remove_stale_work_dirs(self) -> None:
        now = time.time()
        for child in self.root.iterdir():
            if not child.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
                continue
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > _STALE_SECONDS or child.name.startswith(_TRASH_PREFIX):
                    shutil.rmtree(child, ignore_errors=True)
