"""Content-addressed model files: ``<state_dir>/models/<sha256>.onnx``.

A model enters the store only through :meth:`ModelStore.adopt`, which checks the whole file's
SHA-256 and then renames it into place (same file system: atomic) and fsyncs the directory, so the
store never holds a torn or unverified file under a hash name. Which models are active or
last-known-good is recorded in ``state.json`` (:mod:`agent.state.file`); :meth:`ModelStore.gc` is told
which ones to protect.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import structlog

from agent.errors import DiskFullError, HashMismatchError
from agent.fsutil import atomic_writer, fsync_directory, sha256_file

log = structlog.get_logger(__name__)

MODEL_SUFFIX = ".onnx"
_MODEL_NAME = re.compile(r"^([0-9a-f]{64})\.onnx$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MIB = 1024 * 1024


class DiskUsage(NamedTuple):
    """What :func:`shutil.disk_usage` returns (bytes)."""

    total: int
    used: int
    free: int


#: Returns the usage of the file system holding a path; :func:`shutil.disk_usage` unless injected.
DiskUsageFn = Callable[[Path], DiskUsage]


def _disk_usage(path: Path) -> DiskUsage:
    total, used, free = shutil.disk_usage(path)
    return DiskUsage(total, used, free)


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB"


class ModelStore:
    """The models directory. Thread-safe: adopt and gc take one lock."""

    def __init__(self, root: Path, *, disk_usage: DiskUsageFn = _disk_usage) -> None:
        self.root = Path(root)
        self._disk_usage = disk_usage
        self._lock = threading.Lock()

    @staticmethod
    def _check_sha(sha256: str) -> str:
        if not _SHA256.match(sha256):
            raise ValueError(f"not a lowercase hex SHA-256: {sha256!r}")
        return sha256

    @staticmethod
    def sha_named(path: str | Path) -> str | None:
        """The SHA-256 a stored file's name carries (``<sha256>.onnx``), None for any other name."""
        match = _MODEL_NAME.match(Path(path).name)
        return match.group(1) if match else None

    def path_for(self, sha256: str) -> Path:
        """Where the model with this SHA-256 lives (whether or not it is there)."""
        return self.root / f"{self._check_sha(sha256)}{MODEL_SUFFIX}"

    def has(self, sha256: str) -> bool:
        """True if the model is in the store."""
        return self.path_for(sha256).is_file()

    def touch(self, sha256: str) -> None:
        """Mark a stored model as just used (gc removes the least recently used first)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path_for(sha256))

    def adopt(self, src: Path, sha256: str) -> Path:
        """Move the complete file ``src`` into the store as ``sha256``; return its store path.

        The whole file is hashed first; a mismatch removes ``src`` and raises :class:`HashMismatchError`.
        """
        target = self.path_for(sha256)
        src = Path(src)
        actual = sha256_file(src)
        if actual != sha256:
            with contextlib.suppress(FileNotFoundError):
                src.unlink()
            raise HashMismatchError(
                f"model file SHA-256 is {actual} but the manifest says {sha256}; the file was discarded. "
                "Every chunk matched its hash, so the manifest itself is inconsistent: rebuild it with "
                "`edge-agent fleet deploy`"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            # The writer may not have fsynced: the rename must not become durable before the data.
            with open(src, "rb") as f:
                os.fsync(f.fileno())
            try:
                os.replace(src, target)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                # partial/ on another file system than models/: copy atomically instead.
                with open(src, "rb") as f_in, atomic_writer(target) as f_out:
                    shutil.copyfileobj(f_in, f_out, 1024 * 1024)
                src.unlink()
            fsync_directory(self.root)
        log.info("store.adopted", sha256=sha256, path=str(target))
        return target

    def check_free_space(self, size: int, headroom: int) -> None:
        """Raise :class:`DiskFullError` unless ``size + headroom`` bytes are free where the store lives."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = self._disk_usage(self.root).free
        needed = size + headroom
        if free < needed:
            raise DiskFullError(
                f"not enough disk space in {self.root}: need {_mib(needed)} (model {_mib(size)} + headroom "
                f"{_mib(headroom)}) but only {_mib(free)} is free; free space on the device or lower "
                "delivery.disk_headroom_bytes"
            )

    def models(self) -> dict[str, Path]:
        """Every stored model by SHA-256."""
        out: dict[str, Path] = {}
        if not self.root.is_dir():
            return out
        for entry in self.root.iterdir():
            match = _MODEL_NAME.match(entry.name)
            if match and entry.is_file():
                out[match.group(1)] = entry
        return out

    def gc(self, protect: set[str], keep: int) -> list[Path]:
        """Remove stray temp files and all but the ``keep`` newest unprotected models; return what went.

        ``protect`` (active, last-known-good, models of running jobs) is never removed. "Newest" is by
        modification time, which :meth:`adopt` and :meth:`touch` refresh.
        """
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        with self._lock:
            for entry in self.root.iterdir():
                # Leftovers of atomic writes cut short by a crash (adopt holds the lock while writing).
                if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file():
                    entry.unlink(missing_ok=True)
                    removed.append(entry)
            candidates = []
            for sha, path in self.models().items():
                if sha in protect:
                    continue
                try:
                    candidates.append((path.stat().st_mtime, path))
                except FileNotFoundError:
                    continue
            candidates.sort(reverse=True)
            for _, path in candidates[keep:]:
                path.unlink(missing_ok=True)
                removed.append(path)
            if removed:
                fsync_directory(self.root)
        if removed:
            log.info("store.gc", removed=[p.name for p in removed], kept=len(candidates[:keep]))
        return removed
