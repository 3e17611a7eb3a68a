"""V4L2 sources. There is no camera on this machine: these tests cover the failure path."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.camera.source import SourceState
from agent.camera.source_spec import V4L2SourceSpec
from tests.camera.recorder import Recorder
from tests.camera.specs import make

S = SourceState
MISSING = "/dev/video99"


@pytest.fixture(autouse=True)
def _no_such_device() -> None:
    if Path(MISSING).exists():
        pytest.skip(f"{MISSING} exists on this machine")


def test_missing_device_reconnects_with_backoff_until_stopped() -> None:
    spec = make(
        V4L2SourceSpec,
        device=MISSING,
        width=640,
        height=480,
        fps=30,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
    )
    rec = Recorder("usb", spec).start()
    rec.wait_until("three reconnect attempts", lambda: rec.count(S.RECONNECTING) >= 3)
    rec.stop()
    seen = rec.transitions()
    assert seen[0] == (S.IDLE, S.CONNECTING)
    # It alternates CONNECTING -> RECONNECTING -> CONNECTING ... and never streams.
    for (_, new), (old, _) in itertools.pairwise(seen):
        assert new is old
    assert S.STREAMING not in {new for _, new in seen}
    assert seen[-1][1] is S.STOPPED
    for event in rec.events:
        if event.new is S.RECONNECTING:
            assert f"camera device {MISSING} does not exist" in event.reason
    assert rec.source.stats()["open_failures"] >= 3
    assert rec.source.state is S.STOPPED


def test_stop_during_backoff_returns_promptly() -> None:
    spec = make(V4L2SourceSpec, device=MISSING, reconnect_min_s=60.0, reconnect_max_s=120.0)
    rec = Recorder("usb", spec).start()
    rec.wait_until("the first failure", lambda: rec.count(S.RECONNECTING) == 1)
    rec.stop(timeout_s=10.0)  # asserts the iterator returned, long before the 60 s backoff ends
    assert rec.transitions()[-1] == (S.RECONNECTING, S.STOPPED)


def test_close_during_backoff_returns_promptly() -> None:
    spec = make(V4L2SourceSpec, device=MISSING, reconnect_min_s=60.0, reconnect_max_s=120.0)
    rec = Recorder("usb", spec).start()
    rec.wait_until("the first failure", lambda: rec.count(S.RECONNECTING) == 1)
    rec.source.close()
    rec.finish(timeout_s=10.0)  # asserts the iterator returned, long before the 60 s backoff ends
    assert rec.transitions()[-1] == (S.RECONNECTING, S.STOPPED)


def test_a_file_that_is_not_a_capture_device_is_reported(tmp_path: Path) -> None:
    fake_node = tmp_path / "video0"
    fake_node.write_bytes(b"")
    spec = make(V4L2SourceSpec, device=str(fake_node), reconnect_min_s=0.05, reconnect_max_s=0.1)
    rec = Recorder("usb", spec).start()
    rec.wait_until("a reconnect", lambda: rec.count(S.RECONNECTING) >= 1)
    rec.stop()
    reason = next(e.reason for e in rec.events if e.new is S.RECONNECTING)
    assert "could not open" in reason
    assert "V4L2" in reason
