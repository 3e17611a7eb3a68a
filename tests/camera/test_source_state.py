"""The state machine of VideoSource: transition table, backoff, events, close and stop."""

from __future__ import annotations

import itertools
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from agent.camera.source import (
    ALLOWED,
    STATE_CODES,
    SourceEvent,
    SourceState,
    VideoSource,
    backoff_delay,
    check_transition,
)
from agent.camera.source_spec import FileSourceSpec, SyntheticSourceSpec
from tests.camera.recorder import Recorder
from tests.camera.specs import make

S = SourceState


def test_states_are_lower_case_strings() -> None:
    assert [s.value for s in SourceState] == [
        "idle",
        "connecting",
        "streaming",
        "reconnecting",
        "ended",
        "stopped",
    ]
    assert SourceState("streaming") is S.STREAMING
    assert isinstance(S.STOPPED, str)
    assert str.__eq__(S.STOPPED, "stopped")


def test_table_covers_every_state_and_terminal_states_lead_nowhere() -> None:
    assert set(ALLOWED) == set(SourceState)
    assert ALLOWED[S.ENDED] == frozenset()
    assert ALLOWED[S.STOPPED] == frozenset()
    # Every live state can be stopped.
    for state in (S.IDLE, S.CONNECTING, S.STREAMING, S.RECONNECTING):
        assert S.STOPPED in ALLOWED[state]
    assert sorted(STATE_CODES.values()) == list(range(len(SourceState)))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (S.IDLE, S.STREAMING),
        (S.RECONNECTING, S.STREAMING),
        (S.STREAMING, S.CONNECTING),
        (S.ENDED, S.CONNECTING),
        (S.STOPPED, S.CONNECTING),
        (S.STOPPED, S.STOPPED),
    ],
)
def test_illegal_transition_is_rejected(old: SourceState, new: SourceState) -> None:
    with pytest.raises(RuntimeError, match="illegal camera source transition"):
        check_transition(old, new)


def test_legal_transitions_pass() -> None:
    for old, targets in ALLOWED.items():
        for new in targets:
            check_transition(old, new)


def test_source_rejects_illegal_transition_and_keeps_its_state() -> None:
    events: list[SourceEvent] = []
    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8), on_event=events.append)
    with pytest.raises(RuntimeError):
        # Private on purpose: the public API cannot make an illegal change, which is the point.
        source._transition(S.STREAMING, "skipping CONNECTING")
    assert source.state is S.IDLE
    assert events == []


def test_backoff_doubles_within_bounds_with_jitter() -> None:
    rng = random.Random(7)
    assert backoff_delay(1, 0.5, 30.0, rng) == 0.5  # the first retry waits the minimum
    delays = [backoff_delay(n, 0.5, 30.0, rng) for n in range(1, 40)]
    assert all(0.5 <= d <= 30.0 for d in delays)
    assert 2.0 <= backoff_delay(4, 0.5, 30.0, rng) <= 4.0  # base 4 s, jitter in the upper half
    late = [backoff_delay(30, 0.5, 30.0, rng) for _ in range(50)]
    assert all(15.0 <= d <= 30.0 for d in late)
    assert len(set(late)) > 1  # jittered, not in step
    assert backoff_delay(1000, 0.5, 30.0, rng) <= 30.0  # no overflow


def test_backoff_with_min_above_max_waits_min() -> None:
    assert backoff_delay(5, 3.0, 1.0) == 3.0


def test_event_sequence_of_a_finite_stream_and_stats() -> None:
    rec = Recorder("cam0", make(SyntheticSourceSpec, width=32, height=24, fps=0, frames=3)).start()
    rec.finish()
    assert rec.transitions() == [(S.IDLE, S.CONNECTING), (S.CONNECTING, S.STREAMING), (S.STREAMING, S.ENDED)]
    assert all(e.stream == "cam0" and e.reason for e in rec.events)
    assert [e.ts for e in rec.events] == sorted(e.ts for e in rec.events)
    stats = rec.source.stats()
    age = stats.pop("last_frame_age_s")
    assert 0.0 <= age < 60.0  # seconds since the third frame, on a loaded machine
    assert stats == {
        "frames": 3.0,
        "reconnects": 0.0,
        "read_failures": 0.0,
        "open_failures": 0.0,
        "state": float(STATE_CODES[S.ENDED]),
        "gaps": 0.0,
        "gap_s": 0.0,
        "frames_missed": 0.0,
    }
    rec.source.close()  # after ENDED: idempotent, the state stays ENDED
    assert rec.source.state is S.ENDED


def test_frames_may_be_iterated_once() -> None:
    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8, fps=0, frames=1))
    stop = threading.Event()
    assert len(list(source.frames(stop))) == 1
    with pytest.raises(RuntimeError, match="already ended"):
        next(source.frames(stop))


def test_stop_set_before_start_stops_without_opening() -> None:
    events: list[SourceEvent] = []
    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8), on_event=events.append)
    stop = threading.Event()
    stop.set()
    assert list(source.frames(stop)) == []
    assert [(e.old, e.new) for e in events] == [(S.IDLE, S.STOPPED)]


def test_close_is_idempotent_and_a_closed_source_yields_nothing() -> None:
    events: list[SourceEvent] = []
    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8), on_event=events.append)
    source.close()
    source.close()
    assert source.state is S.STOPPED
    assert list(source.frames(threading.Event())) == []
    assert [(e.old, e.new) for e in events] == [(S.IDLE, S.STOPPED)]


def test_close_from_another_thread_ends_a_running_iterator() -> None:
    rec = Recorder("s", make(SyntheticSourceSpec, width=16, height=16, fps=100)).start()
    rec.wait_until("a few frames", lambda: rec.frame_count() >= 3)
    rec.source.close()
    rec.finish()
    assert rec.source.state is S.STOPPED
    assert rec.events[-1].old is S.STREAMING
    assert rec.events[-1].new is S.STOPPED
    assert rec.events[-1].reason == "closed"
    assert rec.count(S.STOPPED) == 1


def test_stop_event_ends_a_running_iterator() -> None:
    rec = Recorder("s", make(SyntheticSourceSpec, width=16, height=16, fps=0)).start()
    rec.wait_until("frames", lambda: rec.frame_count() >= 5)
    rec.stop()
    assert rec.transitions()[-1] == (S.STREAMING, S.STOPPED)
    indices = [f.index for f in rec.frames]
    assert indices == list(range(len(indices)))


def test_consumer_closing_the_iterator_stops_the_source() -> None:
    events: list[SourceEvent] = []
    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8, fps=0), on_event=events.append)
    frames = source.frames(threading.Event())
    assert next(frames).index == 0
    frames.close()
    assert source.state is S.STOPPED
    assert events[-1].reason == "frame iterator closed by its consumer"


def test_failing_event_callback_does_not_break_the_source() -> None:
    def explode(event: SourceEvent) -> None:
        raise ValueError("callback bug")

    source = VideoSource("s", make(SyntheticSourceSpec, width=8, height=8, fps=0, frames=2), on_event=explode)
    assert [f.index for f in source.frames(threading.Event())] == [0, 1]
    assert source.state is S.ENDED


def test_synthetic_frames_are_bgr_moving_and_numbered() -> None:
    source = VideoSource("syn", make(SyntheticSourceSpec, width=64, height=48, fps=0, frames=4))
    assert source.is_live
    frames = list(source.frames(threading.Event()))
    assert [f.index for f in frames] == [0, 1, 2, 3]
    for f in frames:
        assert f.stream == "syn"
        assert f.image.shape == (48, 64, 3)
        assert f.image.dtype == np.uint8
        assert f.image.flags["C_CONTIGUOUS"]
    # The moving box makes every frame differ from the previous one.
    for a, b in itertools.pairwise(frames):
        assert not np.array_equal(a.image, b.image)
    assert frames[0].captured_mono <= frames[-1].captured_mono
    assert source.state is S.ENDED


def test_synthetic_paced_source_reports_its_rate() -> None:
    source = VideoSource("syn", make(SyntheticSourceSpec, width=16, height=16, fps=200, frames=3))
    assert [f.index for f in source.frames(threading.Event())] == [0, 1, 2]
    assert source.nominal_fps == 200


def test_failures_are_logged_with_their_reason(tmp_path: Path) -> None:
    spec = make(FileSourceSpec, path=tmp_path / "gone.mp4", reconnect_min_s=0.05, reconnect_max_s=0.1)
    with capture_logs() as logs:
        rec = Recorder("cam", spec).start()
        rec.wait_until("a reconnect", lambda: rec.count(S.RECONNECTING) >= 1)
        rec.stop()
    failed = [entry for entry in logs if entry["event"] == "camera.source.failed"]
    assert failed
    assert failed[0]["stream"] == "cam"
    assert failed[0]["phase"] == "open"
    assert "gone.mp4 does not exist" in failed[0]["reason"]
    assert failed[0]["retry_in_s"] >= 0.05
    states = [entry for entry in logs if entry["event"] == "camera.source.state"]
    assert states[0]["new"] == "connecting"
