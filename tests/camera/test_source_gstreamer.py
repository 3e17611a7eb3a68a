"""GStreamer sources: a real gst-launch-1.0 child process running videotestsrc."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from agent.camera.drivers.gstreamer import GStreamerDriver, pipeline_fps
from agent.camera.source import SourceState
from agent.camera.source_spec import GStreamerSourceSpec
from agent.errors import SourceError
from tests.camera.recorder import Recorder
from tests.camera.specs import make

S = SourceState
W, H = 64, 48
CAPS = f"video/x-raw,format=BGR,width={W},height={H}"

pytestmark = pytest.mark.skipif(
    shutil.which("gst-launch-1.0") is None, reason="gst-launch-1.0 missing: run `make os-deps`"
)


def spec(pipeline: str, **kw: float) -> GStreamerSourceSpec:
    return make(GStreamerSourceSpec, pipeline=pipeline, width=W, height=H, **kw)


def gone(pid: int) -> bool:
    """True when ``pid`` is neither running nor a zombie waiting to be reaped."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return True
    # The pid may have been reused by an unrelated process; then ours is gone too.
    return "gst-launch" not in status.read_text()


def test_pipeline_fps_is_read_from_the_caps() -> None:
    assert pipeline_fps(f"videotestsrc ! {CAPS},framerate=30/1") == 30.0
    assert pipeline_fps("a ! video/x-raw,framerate=(fraction)15/2 ! b ! video/x-raw,framerate=5/1") == 5.0
    assert pipeline_fps("videotestsrc ! video/x-raw,framerate=0/1") is None
    assert pipeline_fps(f"videotestsrc ! {CAPS}") is None


def test_frames_arrive_and_process_exit_becomes_a_reconnect() -> None:
    # num-buffers=5: the child exits after 5 frames, the source restarts it and keeps counting.
    pipeline = f"videotestsrc num-buffers=5 pattern=white ! {CAPS}"
    rec = Recorder("gst", spec(pipeline, reconnect_min_s=0.05, reconnect_max_s=0.1)).start()
    rec.wait_until("frames from a second run of the pipeline", lambda: rec.frame_count() >= 8)
    rec.stop()
    indices = [f.index for f in rec.frames]
    assert indices == list(range(len(indices)))
    for f in rec.frames:
        assert f.image.shape == (H, W, 3)
        assert f.image.dtype == np.uint8
        assert bool((f.image == 255).all())  # white, so the bytes are cut at frame boundaries
    first_loss = next(e for e in rec.events if e.new is S.RECONNECTING)
    assert first_loss.old is S.STREAMING
    assert "exited with code 0 after 5 frames" in first_loss.reason
    assert rec.transitions()[:5] == [
        (S.IDLE, S.CONNECTING),
        (S.CONNECTING, S.STREAMING),
        (S.STREAMING, S.RECONNECTING),
        (S.RECONNECTING, S.CONNECTING),
        (S.CONNECTING, S.STREAMING),
    ]
    assert rec.source.stats()["read_failures"] >= 1


def test_pipeline_that_does_not_parse_is_retried_with_the_reason() -> None:
    pipeline = f"nosuchelement ! {CAPS}"
    rec = Recorder("gst", spec(pipeline, reconnect_min_s=0.05, reconnect_max_s=0.1)).start()
    rec.wait_until("two reconnects", lambda: rec.count(S.RECONNECTING) >= 2)
    rec.stop()
    reason = next(e.reason for e in rec.events if e.new is S.RECONNECTING)
    assert 'no element "nosuchelement"' in reason
    assert rec.frames == []
    assert rec.source.state is S.STOPPED


def test_unbalanced_quote_is_a_source_error() -> None:
    driver = GStreamerDriver(spec('videotestsrc ! textoverlay text="oops'))
    with pytest.raises(SourceError, match="quoting"):
        driver.open()


def test_close_reaps_a_running_child() -> None:
    driver = GStreamerDriver(spec(f"videotestsrc is-live=true ! {CAPS},framerate=30/1"))
    driver.open()
    try:
        assert driver.nominal_fps == 30.0
        image = driver.read(timeout_s=5.0)
        assert image is not None
        assert image.shape == (H, W, 3)
        pid = driver.pid
        assert pid is not None
    finally:
        driver.close()
    assert driver.pid is None
    assert gone(pid)
    driver.close()  # idempotent


def test_close_reaps_a_child_blocked_writing_into_a_full_pipe() -> None:
    # Not live: videotestsrc runs as fast as it can, fills the pipe and blocks in write().
    driver = GStreamerDriver(spec(f"videotestsrc ! {CAPS}"))
    driver.open()
    assert driver.read(timeout_s=5.0) is not None
    pid = driver.pid
    assert pid is not None
    time.sleep(0.3)
    driver.close()
    assert gone(pid)


def test_close_reaps_a_child_that_exited_by_itself() -> None:
    driver = GStreamerDriver(spec(f"videotestsrc num-buffers=1 ! {CAPS}"))
    driver.open()
    pid = driver.pid
    assert pid is not None
    assert driver.read(timeout_s=5.0) is not None
    with pytest.raises(SourceError, match="exited with code 0 after 1 frames"):
        driver.read(timeout_s=5.0)
    driver.close()
    assert gone(pid)


def test_a_stalled_pipeline_times_out_instead_of_hanging() -> None:
    # One frame every 5 s: the second read must give up after its timeout.
    driver = GStreamerDriver(spec(f"videotestsrc is-live=true ! {CAPS},framerate=1/5"))
    driver.open()
    try:
        assert driver.read(timeout_s=5.0) is not None
        with pytest.raises(SourceError, match="no frame within"):
            driver.read(timeout_s=0.3)
    finally:
        driver.close()


def test_source_close_reaps_the_child() -> None:
    rec = Recorder("gst", spec(f"videotestsrc is-live=true ! {CAPS},framerate=50/1")).start()
    rec.wait_until("frames", lambda: rec.frame_count() >= 2)
    driver = rec.source._driver  # the child's pid is an implementation detail of the driver
    assert isinstance(driver, GStreamerDriver)
    pid = driver.pid
    assert pid is not None
    rec.source.close()
    rec.finish()
    assert gone(pid)
    assert rec.source.state is S.STOPPED
