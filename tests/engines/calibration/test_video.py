"""Calibration frames from a real video written by OpenCV, and from a real MJPEG stream on loopback."""

from __future__ import annotations

from pathlib import Path

import cv2
import pytest

from agent.demo.setup import write_demo_video
from agent.engines.calibration.data import dataset_images
from agent.engines.calibration.video import STREAM_STRIDE, frame_numbers, write_calibration_frames
from agent.errors import BuildError
from tests.camera.mjpeg_server import MjpegServer


@pytest.fixture
def video(tmp_path: Path) -> Path:
    return write_demo_video(tmp_path / "lobby.avi", frames=30, size=(96, 64), fps=15.0)


def test_frame_numbers_spread_over_the_whole_video() -> None:
    assert frame_numbers(150, 4) == [0, 37, 75, 112]
    assert frame_numbers(3, 10) == [0, 1, 2]
    assert frame_numbers(10, 10) == list(range(10))


def test_frames_spread_over_a_video_become_a_calibration_folder(tmp_path: Path, video: Path) -> None:
    out = tmp_path / "calib"
    written = write_calibration_frames(str(video), out, 5)
    assert [p.name for p in written] == [f"frame-{n:06d}.jpg" for n in (0, 6, 12, 18, 24)]
    assert dataset_images(out) == written  # what --calib DIR reads
    image = cv2.imread(str(written[2]))
    assert image is not None
    assert image.shape == (64, 96, 3)


def test_a_video_shorter_than_asked_gives_all_its_frames(tmp_path: Path, video: Path) -> None:
    assert len(write_calibration_frames(str(video), tmp_path / "calib", 200)) == 30


def test_a_stream_of_unknown_length_gives_every_tenth_frame(tmp_path: Path) -> None:
    server = MjpegServer(width=64, height=48, fps=100.0).start()
    try:
        written = write_calibration_frames(server.url, tmp_path / "calib", 3)
    finally:
        server.stop()
    assert [p.name for p in written] == [f"frame-{n:06d}.jpg" for n in (0, STREAM_STRIDE, 2 * STREAM_STRIDE)]


@pytest.mark.parametrize(
    ("case", "problem"),
    [
        ("missing", "no such video file"),
        ("not-a-video", "cannot open it"),
        ("folder-with-images", "already holds images"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, video: Path, case: str, problem: str) -> None:
    out = tmp_path / "calib"
    source = str(video)
    if case == "missing":
        source = str(tmp_path / "nope.avi")
    elif case == "not-a-video":
        source = str(tmp_path / "notes.avi")
        Path(source).write_text("not a video")
    else:
        out.mkdir()
        (out / "old.png").write_bytes(write_calibration_frames(str(video), tmp_path / "x", 1)[0].read_bytes())
    with pytest.raises(BuildError, match=problem):
        write_calibration_frames(source, out, 5)
