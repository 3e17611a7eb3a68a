"""Calibration caches on disk, keyed so that a cache is reused exactly when it is still valid.

A calibration depends on the model, the algorithm, the backend that computes or consumes it (and
its exact version: TensorRT ignores caches of another version, TensorRT#1378) and the frames it saw.
:class:`CalibrationKey` hashes those five; the store keeps, under ``<state_dir>/calibration/``:

- ``<key>.json``: the ranges as a calibration table
  (:func:`agent.model_contract.calibration_table.write_table` format, plus the key's fields), what
  ONNX Runtime quantizes with;
- ``<key>.trtcache``: optionally the same calibration in TensorRT's cache format.

:func:`collect_frames` takes N frames from a live stream and preprocesses them into batches, and
:func:`data_sha256` hashes those batches for the key. :meth:`CalibrationStore.get_or_calibrate`
runs the (slow) calibration only when no valid entry exists.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.camera.frame import Frame
from agent.camera.preprocess import preprocess as preprocess_frame
from agent.engines.cache.key import model_sha256
from agent.engines.guard.agreement import Preprocess
from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes
from agent.model_contract.calibration_table import Method, read_table, write_table
from agent.model_contract.trt_cache import read_trt_cache
from agent.specs.preprocess import PreprocessSpec

log = structlog.get_logger(__name__)

#: Bump when the key's contents or canonical form change: old entries then simply stop matching.
KEY_SCHEMA = 1


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration depends on. ``algorithm`` is ``entropy`` or ``minmax``."""

    model_sha256: str
    algorithm: Method
    backend: str
    backend_version: str
    data_sha256: str

    @classmethod
    def for_batches(
        cls,
        model: Path,
        batches: Sequence[npt.NDArray[Any]],
        *,
        algorithm: Method,
        backend: str,
        backend_version: str,
    ) -> CalibrationKey:
        """The key of calibrating ``model`` on ``batches`` (hashes the model with its external data)."""
        return cls(model_sha256(Path(model)), algorithm, backend, backend_version, data_sha256(batches))

    def digest(self) -> str:
        """SHA-256 hex of the key's canonical JSON: the entry's file name."""
        canonical = json.dumps(
            {"key_schema": KEY_SCHEMA, **asdict(self)},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class StoredCalibration:
    """One store entry: the ranges and where the table (and TensorRT cache, if any) live."""

    key: CalibrationKey
    table_path: Path
    ranges: dict[str, tuple[float, float]]
    method: Method
    trt_cache_path: Path | None


class CalibrationStore:
    """Calibration tables under ``<state_dir>/calibration``; a corrupt entry reads as missing."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "calibration"

    def table_path(self, key: CalibrationKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def trt_cache_path(self, key: CalibrationKey) -> Path:
        return self.root / f"{key.digest()}.trtcache"

    def get(self, key: CalibrationKey) -> StoredCalibration | None:
        """The entry for ``key``, or None when it is missing, unreadable or not this key's."""
        path = self.table_path(key)
        if not path.is_file():
            return None
        try:
            ranges, method = read_table(path)
            stored_key = json.loads(path.read_text(encoding="utf-8")).get("key")
        except (BuildError, OSError, ValueError) as exc:
            log.warning("engine.calibration.unreadable", path=str(path), error=str(exc))
            return None
        if stored_key != asdict(key) or method != key.algorithm:
            log.warning("engine.calibration.mismatch", path=str(path))
            return None
        trt = self.trt_cache_path(key)
        return StoredCalibration(key, path, ranges, method, trt if trt.is_file() else None)

    def put(
        self,
        key: CalibrationKey,
        ranges: Mapping[str, tuple[float, float]],
        *,
        trt_cache: bytes | None = None,
    ) -> StoredCalibration:
        """Store ``ranges`` (and optionally a TensorRT cache) under ``key``, atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.table_path(key)
        write_table(path, ranges, method=key.algorithm, extra={"key": asdict(key)})
        if trt_cache is not None:
            self.put_trt_cache(key, trt_cache)
        stored = self.get(key)
        if stored is None:  # pragma: no cover - only if the disk lies about what was just written
            raise BuildError(f"calibration table {path} cannot be read back after writing: check the disk")
        log.info("engine.calibration.stored", key=key.digest(), tensors=len(stored.ranges))
        return stored

    def get_trt_cache(self, key: CalibrationKey) -> bytes | None:
        """The TensorRT cache stored for ``key``, or None when missing or not a valid cache."""
        path = self.trt_cache_path(key)
        try:
            data = path.read_bytes()
            read_trt_cache(data)
        except FileNotFoundError:
            return None
        except (OSError, BuildError) as exc:
            log.warning("engine.calibration.unreadable", path=str(path), error=str(exc))
            return None
        return data

    def put_trt_cache(self, key: CalibrationKey, data: bytes) -> Path:
        """Store a TensorRT calibration cache for ``key`` (validated first)."""
        read_trt_cache(data)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.trt_cache_path(key)
        atomic_write_bytes(path, data)
        return path

    def get_or_calibrate(
        self, key: CalibrationKey, calibrate: Callable[[], Mapping[str, tuple[float, float]]]
    ) -> tuple[StoredCalibration, bool]:
        """The stored entry for ``key``, calibrating (and storing) only when there is none.

        Returns ``(entry, reused)``.
        """
        stored = self.get(key)
        if stored is not None:
            log.info("engine.calibration.reused", key=key.digest())
            return stored, True
        return self.put(key, calibrate()), False


def data_sha256(batches: Iterable[npt.NDArray[Any]]) -> str:
    """SHA-256 of calibration batches: each batch's dtype, shape and bytes, in order."""
    digest = hashlib.sha256()
    for batch in batches:
        array = np.ascontiguousarray(batch)
        digest.update(f"{array.dtype.str}{array.shape}".encode("ascii"))
        digest.update(array.tobytes())
    return digest.hexdigest()


def collect_frames(
    frames_iter: Iterable[Frame | npt.NDArray[np.uint8]],
    n: int,
    preprocess: Preprocess,
    *,
    batch_size: int = 16,
    every: int = 1,
    timeout_s: float | None = None,
) -> list[npt.NDArray[Any]]:
    """Take ``n`` frames from a stream and preprocess them into batches (batch axis first).

    ``every`` keeps one frame in that many, so calibration covers more of the scene than a
    second of near-identical frames. Stops early, with what it has, when the stream ends or
    ``timeout_s`` has passed (checked between frames); BuildError when it got no frame at all.
    The result feeds :func:`agent.engines.calibration.int8.quantize_int8` and :func:`data_sha256` directly.
    """
    if n < 1 or batch_size < 1 or every < 1:
        raise ValueError(f"n, batch_size and every must be >= 1 (got {n}, {batch_size}, {every})")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    tensors: list[npt.NDArray[Any]] = []
    for seen, frame in enumerate(frames_iter):
        if seen % every == 0:
            image = frame.image if isinstance(frame, Frame) else frame
            if isinstance(preprocess, PreprocessSpec):
                tensors.append(preprocess_frame(image, preprocess)[0])
            else:
                tensors.append(preprocess(image))
            if len(tensors) >= n:
                break
        if deadline is not None and time.monotonic() >= deadline:
            log.warning("engine.calibration.frames_timeout", wanted=n, got=len(tensors))
            break
    if not tensors:
        raise BuildError(
            "no calibration frames arrived from the stream: check the camera, then calibrate again"
        )
    if len(tensors) < n:
        log.warning("engine.calibration.frames_short", wanted=n, got=len(tensors))
    return [np.stack(tensors[i : i + batch_size]) for i in range(0, len(tensors), batch_size)]
