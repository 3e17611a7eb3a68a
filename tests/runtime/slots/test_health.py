"""The probation's judgement (pure): which figure fails, when, and how the latency is judged."""

from __future__ import annotations

import dataclasses

from agent.protocol.messages import FailedFigure
from agent.protocol.proving import ProbationSpec
from agent.runtime.slots.health import HealthFigures, ModelHealth, judge

BARS = ProbationSpec()  # the defaults operators run: p99 3.0, fps 0.8, drops 0.1, class shift 0.5


def figures(**changes: object) -> HealthFigures:
    base = HealthFigures(
        seconds=60.0,
        fps={"cam": 30.0},
        p99_ms=2.0,
        infer_errors=0,
        nan_outputs=0,
        dropped_share=0.0,
        classes={0: 90, 1: 10},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_live_p99_inflated_by_a_busy_machine_fails_nothing_when_both_models_slowed_alike() -> None:
    """The live p99 after the swap is ten times the baseline's (a CPU hog started), but timed on the
    same frames at the same moments the new model costs what the old one does."""
    busy = figures(p99_ms=20.0)
    assert judge(figures(), busy, BARS, final=True, latency_ratio=1.1) is None


def test_a_model_slower_than_the_bar_on_the_same_frames_fails_p99_ratio_with_its_value() -> None:
    failed = judge(figures(), figures(p99_ms=2.5), BARS, final=True, latency_ratio=4.123456)
    assert failed == FailedFigure(figure="p99_ratio", value=4.1235, bar=3.0)


def test_the_latency_bar_is_a_strict_upper_bound() -> None:
    assert judge(figures(), figures(), BARS, final=True, latency_ratio=3.0) is None
    assert judge(figures(), figures(), BARS, final=True, latency_ratio=3.0001) is not None


def test_latency_is_judged_only_at_the_end() -> None:
    assert judge(figures(), figures(), BARS, final=False, latency_ratio=9.0) is None


def test_no_paired_timings_leave_the_latency_unjudged_whatever_the_live_p99() -> None:
    assert judge(figures(), figures(p99_ms=200.0), BARS, final=True, latency_ratio=None) is None


def test_nan_outputs_and_errors_fail_at_once_before_any_ratio() -> None:
    nan = judge(figures(), figures(nan_outputs=1), BARS, final=False, latency_ratio=9.0)
    assert nan == FailedFigure(figure="nan_outputs", value=1, bar=0)
    errors = judge(figures(), figures(infer_errors=2), BARS, final=False, latency_ratio=None)
    assert errors == FailedFigure(figure="infer_errors", value=2, bar=0)


def test_fps_is_judged_before_latency_and_drops_and_class_shift_after() -> None:
    slow_stream = figures(fps={"cam": 20.0})
    failed = judge(figures(), slow_stream, BARS, final=True, latency_ratio=9.0)
    assert failed == FailedFigure(figure="fps_ratio.cam", value=0.6667, bar=0.8)
    drops = judge(figures(), figures(dropped_share=0.2), BARS, final=True, latency_ratio=1.0)
    assert drops == FailedFigure(figure="dropped_increase", value=0.2, bar=0.1)
    shifted = judge(figures(), figures(classes={1: 100}), BARS, final=True, latency_ratio=1.0)
    assert shifted is not None
    assert shifted.figure == "class_shift"
    no_shift_bar = ProbationSpec(max_class_shift=None)
    assert judge(figures(), figures(classes={1: 100}), no_shift_bar, final=True, latency_ratio=1.0) is None


def test_fps_is_judged_against_the_frames_the_capture_handed_the_model_when_fewer() -> None:
    """The camera (or a capture starved by other work) gave 15 fps where the baseline published 30:
    publishing those 15 is all the model could do."""
    slowed_camera = figures(fps={"cam": 15.0}, offered_fps={"cam": 15.0})
    assert judge(figures(), slowed_camera, BARS, final=True, latency_ratio=1.0) is None
    kept_up = figures(fps={"cam": 15.0}, offered_fps={"cam": 30.0})
    failed = judge(figures(), kept_up, BARS, final=True, latency_ratio=1.0)
    assert failed == FailedFigure(figure="fps_ratio.cam", value=0.5, bar=0.8)
    # More frames offered than the baseline published (a faster camera): the baseline is the reference.
    faster_camera = figures(fps={"cam": 20.0}, offered_fps={"cam": 60.0})
    failed = judge(figures(), faster_camera, BARS, final=True, latency_ratio=1.0)
    assert failed == FailedFigure(figure="fps_ratio.cam", value=0.6667, bar=0.8)
    # No frame offered at all (the camera is gone): nothing to judge the model's fps on.
    gone = figures(fps={}, offered_fps={"cam": 0.0})
    assert judge(figures(), gone, BARS, final=True, latency_ratio=None) is None


def test_the_frames_offered_are_counted_per_stream_into_the_figures() -> None:
    health = ModelHealth()
    for _ in range(6):
        health.offered("cam")
    for _ in range(3):
        health.published("cam")
    assert health.first_mono is not None
    got = health.figures(health.first_mono, health.first_mono + 2.0)
    assert got.offered_fps == {"cam": 3.0}
    assert got.fps == {"cam": 1.5}
    assert got.flat()["offered_fps.cam"] == 3.0
