"""Calibration data on its way to a build: dataset images, their identity, and batch files.

The parent reads calibration frames (a dataset directory of images, or frames collected from a
stream) only when a build happens, and hands them to the build child as ``batch_NNNNNN.npy`` files
(:func:`save_batches`, read back in the child by :func:`load_batches`). :func:`calibration_identity`
is what stands for the calibration input in the engine cache key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.engines.cache.key import canonical_json
from agent.errors import BuildError
from agent.fsutil import sha256_file
from agent.specs.build import CalibrationSource
from agent.specs.preprocess import PreprocessSpec

log = structlog.get_logger(__name__)

#: About how many ``calibrating D/T frames`` lines one calibration says (build_progress bounds
#: what is published; this bounds what a child writes to its parent).
PROGRESS_LINES = 20

#: Image files a calibration dataset directory may hold.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})


def dataset_images(directory: Path) -> list[Path]:
    """Image files directly in ``directory``, sorted by name."""
    if not directory.is_dir():
        raise BuildError(f"calibration dataset {directory} is not a directory of images")
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def dataset_batches(directory: Path, preprocess: PreprocessSpec, frames: int) -> Iterator[npt.NDArray[Any]]:
    """Up to ``frames`` images of ``directory``, each preprocessed as a batch of one."""
    import cv2

    from agent.camera.preprocess import preprocess as prepare

    images = dataset_images(directory)
    if not images:
        raise BuildError(
            f"calibration dataset {directory} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    for path in images[:frames]:
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None or image.dtype != np.uint8:
            log.warning("engine.calibration.unreadable_image", path=str(path))
            continue
        tensor, _ = prepare(image.astype(np.uint8, copy=False), preprocess)
        yield tensor[np.newaxis]


def calibration_identity(source: CalibrationSource, preprocess: PreprocessSpec | None) -> str:
    """SHA-256 standing for the calibration input in the engine cache key (see the module doc)."""
    if source.kind == "cache":
        if source.path is None:
            raise BuildError(
                f"calibration artifact {source.artifact!r} was not fetched: only a deployment carries "
                "artifacts; give the cache file's path"
            )
        try:
            return sha256_file(source.path)
        except OSError as exc:
            raise BuildError(f"calibration cache {source.path} is unreadable: {exc}") from exc
    if source.kind == "dataset":
        assert source.path is not None
        files = {p.name: sha256_file(p) for p in dataset_images(source.path)[: source.frames]}
        description: dict[str, Any] = {
            "dataset": files,
            "frames": source.frames,
            "preprocess": preprocess.model_dump(mode="json") if preprocess is not None else None,
        }
    else:
        description = {"stream": source.stream, "frames": source.frames}
    return hashlib.sha256(canonical_json(description)).hexdigest()


def limit_frames(batches: Iterable[npt.NDArray[Any]], frames: int) -> Iterator[npt.NDArray[Any]]:
    """The first ``frames`` frames of ``batches``, cutting the last batch short where needed."""
    seen = 0
    for batch in batches:
        if seen >= frames:
            return
        array = np.asarray(batch)
        take = min(len(array), frames - seen) if array.ndim > 0 else 1
        yield array[:take] if array.ndim > 0 else array
        seen += take


def save_batches(
    batches: Iterable[npt.NDArray[Any]], directory: Path, limit: int | None = None
) -> tuple[int, str]:
    """Write calibration batches as ``batch_NNNNNN.npy`` into ``directory``; returns (count, SHA-256).

    The hash covers each batch's dtype, shape and bytes, so it identifies the calibration data.
    ``limit`` stops after that many batches (an endless stream).
    """
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    count = 0
    for batch in batches:
        if limit is not None and count >= limit:
            break
        array = np.ascontiguousarray(batch)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
        np.save(directory / f"batch_{count:06d}.npy", array, allow_pickle=False)
        count += 1
    return count, digest.hexdigest()


def load_batches(directory: Path, say: Callable[[str], None] | None = None) -> Iterator[npt.NDArray[Any]]:
    """The batches :func:`save_batches` wrote, in order.

    ``say``: told ``calibrating D/T frames`` as the calibrator consumes them (the build progress an
    operator reads), about every twentieth of the frames and at the end. A line is said when the
    calibrator asks for the next batch, so D counts frames it has finished with, not frames read.
    """
    paths = sorted(directory.glob("batch_*.npy"))
    # Only the headers are read to count the frames (memory-mapped): the data is read once, below.
    total = (
        sum(int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0]) for path in paths) if say else 0
    )
    step = max(1, total // PROGRESS_LINES)
    done = said = 0
    for path in paths:
        batch = np.load(path, allow_pickle=False)
        yield batch
        done += int(batch.shape[0]) if batch.ndim else 1
        if say is not None and (done - said >= step or done >= total):
            said = done
            say(f"calibrating {min(done, total)}/{total} frames")
