"""What the watchdog's ``frame_loop`` check sees: calls stuck past a bound, not idle or reconnecting loops.

Real blocking calls: FFmpeg inside ``cv2.VideoCapture.read`` waiting on a camera (a real HTTP MJPEG
server) that stopped sending in the middle of a frame, and ONNX Runtime running a model that takes
over a second per frame. The pipelines publish through a real link to the session's mosquitto.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.camera.source import SourceState, VideoSource
from agent.camera.source_spec import UrlSourceSpec
from tests.camera.mjpeg_server import MjpegServer
from tests.camera.specs import make
from tests.runtime.frames import test_pipeline as base
from tests.runtime.frames.test_pipeline import Rig, loaded_slot, synthetic
from tests.runtime.models import write_slow_classifier
from tests.waiting import patient, wait_until

# test_pipeline's fixtures, under the names pytest looks them up by in this module.
rig = base.rig
models = base.models

#: The heartbeat bound the agent uses; these tests are about calls, not about an idle loop.
STALE_S = 10.0
#: Far below FFmpeg's own 5 s read timeout (UrlSourceSpec.read_timeout_s's default), so the read is
#: seen blocked for seconds before FFmpeg gives up on it.
BOUND_S = 0.5


@pytest.fixture
def camera() -> Iterator[MjpegServer]:
    server = MjpegServer().start()
    yield server
    server.stop()


def test_a_camera_read_blocked_past_the_bound_is_stuck_and_a_reconnecting_camera_is_not(
    rig: Rig, models: dict[str, Path], camera: MjpegServer
) -> None:
    spec = make(UrlSourceSpec, url=camera.url, reconnect_min_s=0.1, reconnect_max_s=0.3)
    pipeline = rig.start(loaded_slot(models["v1"]), {"ipcam": (spec, "keep_newest")})
    source = pipeline.streams[0].source
    wait_until(lambda: rig.counter("stream.ipcam.frames_inferred") >= 5, timeout=20.0, what="first frames")
    assert pipeline.problems(STALE_S, BOUND_S) == []

    camera.stall()  # half a frame, then silence on an open connection: FFmpeg blocks in its read
    wait_until(
        lambda: any(
            "camera driver read() has not returned" in p for p in pipeline.problems(STALE_S, BOUND_S)
        ),
        timeout=4.0,
        what="the blocked read to be reported (before FFmpeg's own 5 s timeout ends it)",
    )
    assert not pipeline.healthy(STALE_S, BOUND_S)
    # Nothing else shows the hang: the source still says STREAMING, the threads all live, the
    # inference loop idles and keeps its heartbeat fresh. That is what the watchdog missed.
    assert source.state is SourceState.STREAMING
    assert pipeline.healthy(STALE_S)

    camera.stop()  # unplugged: the read fails at once, then every reopen is refused
    wait_until(lambda: source.stats()["reconnects"] >= 1, timeout=5.0, what="the source to reconnect")
    failures_before = source.stats()["open_failures"]
    # Sampled all through three more refused reopens and the backoff waits between them.
    samples: list[list[str]] = []
    deadline = time.monotonic() + patient(20.0)
    while source.stats()["open_failures"] < failures_before + 3:
        assert time.monotonic() < deadline, "the source stopped retrying the unplugged camera"
        samples.append(pipeline.problems(STALE_S, BOUND_S))
        time.sleep(0.02)
    assert _state(source) in (SourceState.RECONNECTING, SourceState.CONNECTING)
    assert samples
    assert all(s == [] for s in samples), [s for s in samples if s][:3]


def test_an_inference_call_past_the_bound_is_stuck_even_while_another_worker_idles(
    rig: Rig, tmp_path: Path
) -> None:
    # About 0.7 s per frame on one core here (more on a loaded machine), against a 0.2 s bound.
    slow = write_slow_classifier(tmp_path / "very-slow.onnx", dim=1024, repeats=32)
    # One frame, then none for a minute: one worker runs it, the other idles and, with the single
    # heartbeat the workers share, keeps the loop looking alive.
    pipeline = rig.start(loaded_slot(slow), {"cam": (synthetic(2, fps=1 / 60), "process_all")}, workers=2)
    wait_until(
        lambda: any("has been in infer()" in p for p in pipeline.problems(STALE_S, 0.2)),
        timeout=20.0,
        what="the long inference call to be reported",
    )
    assert pipeline.healthy(0.5)  # the heartbeat alone, even at 0.5 s, does not see it
    wait_until(lambda: rig.counter("stream.cam.frames_inferred") >= 1, timeout=30.0, what="the call to end")
    wait_until(lambda: pipeline.problems(STALE_S, 0.2) == [], timeout=5.0, what="the idle loop to be alive")


def _state(source: VideoSource) -> SourceState:
    # A call, so mypy does not carry the STREAMING asserted above over to this later read.
    return source.state
