"""File sources on real video files written by cv2.VideoWriter (MJPG in AVI works with the wheel)."""

from __future__ import annotations

import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.camera.drivers._cv2capture import SINGLE_THREAD_MAX_PIXELS, decode_threads
from agent.camera.drivers.file import FileDriver
from agent.camera.source import SourceState, VideoSource
from agent.camera.source_spec import FileSourceSpec
from tests.camera.recorder import Recorder
from tests.camera.specs import make

S = SourceState
N_FRAMES = 5
FPS = 30.0
STEP = 40  # frame i is a solid image of value i * STEP, so a decoded frame tells its position


@pytest.fixture
def video(tmp_path: Path) -> Path:
    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), FPS, (64, 48))
    assert writer.isOpened()
    for i in range(N_FRAMES):
        writer.write(np.full((48, 64, 3), i * STEP, dtype=np.uint8))
    writer.release()
    return path


def position(image: np.ndarray) -> int:
    """Which frame of the file an image is (JPEG is lossy: round to the nearest step)."""
    return round(float(image.mean()) / STEP)


def test_play_once_gives_exactly_the_files_frames(video: Path) -> None:
    rec = Recorder("f", make(FileSourceSpec, path=video, loop=False)).start()
    rec.finish()
    assert [f.index for f in rec.frames] == list(range(N_FRAMES))
    assert [position(f.image) for f in rec.frames] == list(range(N_FRAMES))
    for f in rec.frames:
        assert f.image.shape == (48, 64, 3)
        assert f.image.dtype == np.uint8
        assert f.image.flags["C_CONTIGUOUS"]
        assert f.stream == "f"
    assert rec.transitions() == [(S.IDLE, S.CONNECTING), (S.CONNECTING, S.STREAMING), (S.STREAMING, S.ENDED)]
    assert rec.source.is_live is False
    assert rec.source.nominal_fps == pytest.approx(FPS)


def test_loop_starts_the_file_again_and_keeps_counting(video: Path) -> None:
    source = VideoSource("f", make(FileSourceSpec, path=video, loop=True))
    stop = threading.Event()
    frames = []
    for frame in source.frames(stop):
        frames.append(frame)
        if len(frames) == 3 * N_FRAMES + 2:
            stop.set()
    assert [f.index for f in frames] == list(range(3 * N_FRAMES + 2))
    assert [position(f.image) for f in frames] == [i % N_FRAMES for i in range(3 * N_FRAMES + 2)]
    assert source.state is S.STOPPED
    assert source.stats()["reconnects"] == 0


def test_realtime_playback_works(video: Path) -> None:
    # Pacing is not asserted by time (no timing assertions); only that paced playback is complete.
    source = VideoSource("f", make(FileSourceSpec, path=video, loop=False, realtime=True))
    frames = list(source.frames(threading.Event()))
    assert [f.index for f in frames] == list(range(N_FRAMES))
    assert source.state is S.ENDED


def test_missing_file_retries_with_backoff_until_stopped(tmp_path: Path) -> None:
    spec = make(FileSourceSpec, path=tmp_path / "absent.avi", reconnect_min_s=0.05, reconnect_max_s=0.1)
    rec = Recorder("f", spec).start()
    rec.wait_until("two reconnects", lambda: rec.count(S.RECONNECTING) >= 2)
    rec.stop()
    reconnecting = [e for e in rec.events if e.new is S.RECONNECTING]
    assert all("absent.avi does not exist" in e.reason for e in reconnecting)
    assert rec.transitions()[:4] == [
        (S.IDLE, S.CONNECTING),
        (S.CONNECTING, S.RECONNECTING),
        (S.RECONNECTING, S.CONNECTING),
        (S.CONNECTING, S.RECONNECTING),
    ]
    assert rec.source.state is S.STOPPED
    assert rec.frames == []
    stats = rec.source.stats()
    assert stats["open_failures"] >= 2
    assert stats["reconnects"] >= 2


def test_file_that_is_not_a_video_is_retried(tmp_path: Path) -> None:
    junk = tmp_path / "junk.avi"
    junk.write_bytes(b"this is not a video" * 100)
    spec = make(FileSourceSpec, path=junk, reconnect_min_s=0.05, reconnect_max_s=0.1)
    rec = Recorder("f", spec).start()
    rec.wait_until("a reconnect", lambda: rec.count(S.RECONNECTING) >= 1)
    rec.stop()
    assert "junk.avi" in next(e.reason for e in rec.events if e.new is S.RECONNECTING)
    assert rec.source.state is S.STOPPED


@pytest.mark.parametrize(
    ("requested", "width", "height", "expected"),
    [
        (0, 640, 480, 1),  # auto: one thread is the least CPU per frame
        (0, 1920, 1080, 1),
        (0, 3840, 2160, 0),  # 4K: FFmpeg's default threads keep up with the frame rate
        (0, 0, 0, 0),  # size unknown: FFmpeg's default
        (4, 640, 480, 4),  # the operator's number wins
    ],
)
def test_decode_threads_policy(requested: int, width: int, height: int, expected: int) -> None:
    assert decode_threads(requested, width, height) == expected


def test_a_file_is_decoded_on_one_thread_unless_its_frames_are_big_or_the_config_says(
    video: Path, tmp_path: Path
) -> None:
    big = tmp_path / "big.avi"
    width, height = 2048, SINGLE_THREAD_MAX_PIXELS // 2048 + 8
    writer = cv2.VideoWriter(str(big), cv2.VideoWriter.fourcc(*"MJPG"), FPS, (width, height))
    writer.write(np.full((height, width, 3), 80, dtype=np.uint8))
    writer.release()
    for path, requested, expected in ((video, 0, 1), (big, 0, 0), (video, 2, 2)):
        driver = FileDriver(make(FileSourceSpec, path=path, loop=False, decode_threads=requested))
        driver.open()
        try:
            assert driver.decode_threads == expected, path.name
            image = driver.read(1.0)
            assert image is not None
            assert image.shape[:2] == ((48, 64) if path == video else (height, width))
        finally:
            driver.close()
