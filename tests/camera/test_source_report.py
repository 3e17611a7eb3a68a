"""What a source reports to the operator (``VideoSource.report`` for up/info, ``stats`` for
telemetry), against a real RTSP camera on loopback (tests/camera/rtsp_camera.py): its state since
when, its reconnects, the age of its last frame, and its last failure with the credentials stripped.
Passwords are made at run time."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import pytest

from agent.camera.source import MAX_ERROR_CHARS, SourceState, VideoSource, failure_reason
from agent.camera.source_spec import UrlSourceSpec
from agent.errors import SourceError
from tests.camera.rtsp_camera import RtspCamera, rtsp_server_missing
from tests.camera.specs import make
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def camera() -> Iterator[RtspCamera]:
    missing = rtsp_server_missing()
    if missing:
        pytest.skip(missing)
    cam = RtspCamera(user="viewer", width=160, height=120, fps=15).start()
    yield cam
    cam.stop()


def _run(source: VideoSource, stop: threading.Event, frames: list[float]) -> threading.Thread:
    """Iterate ``source`` on a thread (as a capture stage does), noting each frame's capture time."""

    def read() -> None:
        # As it arrives: a list comprehension would keep every frame (and the pool's buffers) alive.
        frames.extend(frame.captured_mono for frame in source.frames(stop))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_wrong_password_is_reported_reconnecting_with_the_reason_and_no_password(
    camera: RtspCamera,
) -> None:
    wrong = secrets.token_urlsafe(12)
    spec = make(UrlSourceSpec, url=camera.url_as("viewer", wrong), reconnect_min_s=0.2, reconnect_max_s=0.5)
    source = VideoSource("door", spec)
    stop, frames = threading.Event(), list[float]()
    thread = _run(source, stop, frames)
    try:
        wait_until(lambda: source.report().reconnects >= 2, what="two reconnects after refused logins")
        report, stats = source.report(), source.stats()
    finally:
        stop.set()
        source.close()
        thread.join()

    assert report.state in {SourceState.RECONNECTING, SourceState.CONNECTING}
    assert (report.frames, frames) == (0, [])
    assert report.last_error is not None
    assert f"rtsp://***@127.0.0.1:{camera.port}/stream" in report.last_error
    assert wrong not in report.last_error
    assert camera.password not in report.last_error
    assert "viewer" not in report.last_error
    assert report.last_error_at is not None
    assert report.last_error_at >= report.since - 1.0  # the failure that put it where it is now
    assert stats["last_frame_age_s"] > 0  # no frame yet: the age counts from the source's start
    assert stats["reconnects"] >= 2


def test_a_streaming_camera_reports_its_frames_and_a_fresh_last_frame_then_its_loss(
    camera: RtspCamera,
) -> None:
    spec = make(UrlSourceSpec, url=camera.url, reconnect_min_s=0.2, reconnect_max_s=0.5)
    source = VideoSource("yard", spec)
    stop, frames = threading.Event(), list[float]()
    thread = _run(source, stop, frames)
    try:
        wait_until(lambda: len(frames) >= 10, what="ten frames from the RTSP camera")
        streaming, stats = source.report(), source.stats()
        since_last = time.monotonic() - frames[-1]
        camera.restart()  # a reboot: the stream is lost, then comes back on the same port
        wait_until(lambda: source.report().reconnects >= 1, what="the loss counted")
        seen = len(frames)
        wait_until(lambda: len(frames) >= seen + 10, what="frames again after the reboot")
        back = source.report()
    finally:
        stop.set()
        source.close()
        thread.join()

    assert streaming.state is SourceState.STREAMING
    assert (streaming.reconnects, streaming.last_error) == (0, None)
    assert streaming.frames >= 10
    # The age is of the newest frame, which is at most as old as the last one this test took.
    assert 0 <= stats["last_frame_age_s"] <= since_last + 0.01
    assert back.state is SourceState.STREAMING
    assert back.reconnects >= 1
    assert back.last_error is not None
    assert camera.password not in back.last_error
    assert "***@" in back.last_error


def test_a_failure_reason_is_cut_to_its_bound_and_loses_every_url_password() -> None:
    password = secrets.token_urlsafe(12)
    long = SourceError(f"rtsp://admin:{password}@10.0.0.5/a and http://u:{password}@cam/b " + "x" * 1000)
    reason = failure_reason(long)
    assert len(reason) == MAX_ERROR_CHARS
    assert password not in reason
    assert reason.startswith("rtsp://***@10.0.0.5/a and http://***@cam/b ")
    assert reason.endswith("...")
