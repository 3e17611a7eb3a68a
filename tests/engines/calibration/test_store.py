"""Calibration caches on disk: keyed reuse, corrupt entries, TensorRT caches, frames from a live stream."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import pytest

from agent.camera.frame import Frame
from agent.camera.source import VideoSource
from agent.camera.source_spec import FileSourceSpec
from agent.datasets.shapes import MODEL_PATH, generate
from agent.engines.calibration.int8 import (
    Int8Result,
    calibrate,
    calibration_table_to_trt,
    quantize_with_ranges,
)
from agent.engines.calibration.store import (
    CalibrationKey,
    CalibrationStore,
    collect_frames,
    data_sha256,
)
from agent.errors import BuildError
from agent.model_contract.trt_cache import read_trt_cache
from agent.specs.preprocess import PreprocessSpec

SPEC = PreprocessSpec(width=64, height=64)


@pytest.fixture(scope="module")
def batches() -> list[npt.NDArray[Any]]:
    images, _ = generate(48, seed=40_001)
    return collect_frames(iter(images), 48, SPEC, batch_size=16)


@pytest.fixture
def key(batches: list[npt.NDArray[Any]]) -> CalibrationKey:
    return CalibrationKey.for_batches(
        MODEL_PATH, batches, algorithm="entropy", backend="onnxruntime", backend_version="1.31.0"
    )


def test_key_changes_with_every_field(key: CalibrationKey) -> None:
    assert key.digest() == dataclasses.replace(key).digest()
    assert len(key.digest()) == 64
    variants = [
        dataclasses.replace(key, model_sha256="0" * 64),
        dataclasses.replace(key, algorithm="minmax"),
        dataclasses.replace(key, backend="tensorrt"),
        dataclasses.replace(key, backend_version="1.30.0"),
        dataclasses.replace(key, data_sha256="1" * 64),
    ]
    assert len({key.digest(), *(v.digest() for v in variants)}) == 6


def test_data_hash_covers_bytes_shape_and_dtype() -> None:
    a = np.zeros((2, 3, 4, 4), dtype=np.float32)
    assert data_sha256([a]) == data_sha256([a.copy()])
    b = a.copy()
    b[1, 2, 3, 3] = 1e-6
    assert data_sha256([a]) != data_sha256([b])
    assert data_sha256([a]) != data_sha256([a.reshape(4, 3, 2, 4)])  # same bytes, other shape
    assert data_sha256([a]) != data_sha256([a.astype(np.float16)])
    assert data_sha256([a[:1], a[1:]]) != data_sha256([a])


def test_second_call_reuses_the_stored_calibration(
    tmp_path: Path, key: CalibrationKey, batches: list[npt.NDArray[Any]]
) -> None:
    store = CalibrationStore(tmp_path)
    calls = 0

    def run_calibration() -> dict[str, tuple[float, float]]:
        nonlocal calls
        calls += 1
        return calibrate(MODEL_PATH, batches, method="entropy")

    first, reused_first = store.get_or_calibrate(key, run_calibration)
    second, reused_second = store.get_or_calibrate(key, run_calibration)
    assert calls == 1
    assert (reused_first, reused_second) == (False, True)
    assert second.ranges == first.ranges
    assert first.table_path == tmp_path / "calibration" / f"{key.digest()}.json"
    # A store opened afresh (an agent restart) still finds it.
    assert CalibrationStore(tmp_path).get_or_calibrate(key, run_calibration)[1] is True
    assert calls == 1
    # Another algorithm is another calibration.
    other = dataclasses.replace(key, algorithm="minmax")
    assert store.get(other) is None
    # The stored ranges quantize without recalibrating.
    result = quantize_with_ranges(MODEL_PATH, tmp_path / "q", second.ranges, method=second.method)
    assert result.model_path.is_file()


def test_corrupt_or_foreign_entries_read_as_missing(tmp_path: Path, key: CalibrationKey) -> None:
    store = CalibrationStore(tmp_path)
    stored = store.put(key, {"images": (0.0, 1.0)})
    assert store.get(key) is not None
    stored.table_path.write_text("{torn")
    assert store.get(key) is None
    # A valid table filed under the wrong name (another key's content) is not trusted either.
    other = dataclasses.replace(key, data_sha256="2" * 64)
    store.put(other, {"images": (0.0, 1.0)})
    store.table_path(key).write_bytes(store.table_path(other).read_bytes())
    assert store.get(key) is None
    # calibrating again repairs the entry
    repaired, reused = store.get_or_calibrate(key, lambda: {"images": (0.0, 0.5)})
    assert not reused
    assert repaired.ranges == {"images": (0.0, 0.5)}
    doc = json.loads(repaired.table_path.read_text())
    assert doc["key"]["data_sha256"] == key.data_sha256


def test_trt_cache_is_stored_next_to_the_table(tmp_path: Path, key: CalibrationKey) -> None:
    store = CalibrationStore(tmp_path)
    ranges = {"images": (0.0, 1.0), "conv1/relu": (0.0, 6.35)}
    result = Int8Result(
        model_path=MODEL_PATH, table_path=tmp_path / "t.json", ranges=ranges, method="entropy"
    )
    data = calibration_table_to_trt(result, "10.3.0")
    stored = store.put(key, ranges, trt_cache=data)
    assert stored.trt_cache_path == tmp_path / "calibration" / f"{key.digest()}.trtcache"
    assert store.get_trt_cache(key) == data
    assert read_trt_cache(store.get_trt_cache(key) or b"").scales["conv1/relu"] == pytest.approx(0.05)
    with pytest.raises(BuildError):
        store.put_trt_cache(key, b"not a cache")
    assert store.get_trt_cache(key) == data  # a refused write leaves the old cache
    assert stored.trt_cache_path is not None
    stored.trt_cache_path.write_bytes(b"TRT-100300-EntropyCalibration2\nimages: zz\n")
    assert store.get_trt_cache(key) is None
    assert store.get_trt_cache(dataclasses.replace(key, backend="tensorrt")) is None


def _write_video(path: Path, images: npt.NDArray[np.uint8]) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 10.0, (64, 64))
    assert writer.isOpened()
    for image in images:
        writer.write(image)
    writer.release()
    return path


def test_collect_frames_from_a_live_video_source(tmp_path: Path) -> None:
    images, _ = generate(30, seed=40_002)
    video = _write_video(tmp_path / "shapes.avi", images)
    source = VideoSource("cam", FileSourceSpec(path=video, loop=True))
    stop = threading.Event()
    frames: Iterator[Frame] = source.frames(stop)
    try:
        batches = collect_frames(frames, 20, SPEC, batch_size=8, every=2, timeout_s=30.0)
    finally:
        stop.set()
        source.close()
    assert [b.shape for b in batches] == [(8, 3, 64, 64), (8, 3, 64, 64), (4, 3, 64, 64)]
    assert all(b.dtype == np.float32 for b in batches)
    # every=2 kept frames 0, 2, 4, ...: frame 2 of the video (MJPEG-lossy) is the second tensor.
    expected = images[2][:, :, ::-1].transpose(2, 0, 1) / 255.0
    assert np.abs(batches[0][1] - expected).mean() < 0.03


def test_collect_frames_stops_when_the_stream_ends_or_stalls() -> None:
    images, _ = generate(5, seed=40_003)
    short = collect_frames(iter(images), 100, SPEC, batch_size=4)
    assert [b.shape[0] for b in short] == [4, 1]
    with pytest.raises(BuildError, match="no calibration frames"):
        collect_frames(iter([]), 10, SPEC)

    def endless() -> Iterator[npt.NDArray[np.uint8]]:
        while True:
            yield images[0]

    # timeout_s=0: the deadline has passed after the first frame.
    assert sum(len(b) for b in collect_frames(endless(), 1000, SPEC, timeout_s=0.0)) == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        collect_frames(iter(images), 0, SPEC)
