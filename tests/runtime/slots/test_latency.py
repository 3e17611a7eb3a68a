"""Latency judged like with like: the pure ratio functions, on timings shaped like real load."""

from __future__ import annotations

import random

import pytest

from agent.runtime.slots.latency import (
    MIN_PAIRS,
    InferenceTime,
    PairedTiming,
    compared_times,
    judged_ratio,
    median_ratio,
    old_first,
)


def pairs(ratios: list[float], *, every_s: float = 0.5, old_ms: float = 2.0) -> list[PairedTiming]:
    """One pair per ``every_s`` seconds, the old model at ``old_ms``, the new one at ``ratio`` times it."""
    return [PairedTiming(i * every_s, old_ms, old_ms * r) for i, r in enumerate(ratios)]


def test_the_median_ratio_is_taken_per_frame_not_of_the_medians() -> None:
    # Per frame: 3, 3.2, 1, 3.1 -> 3.05. The load moved both models' times from frame to frame.
    assert median_ratio([(1.0, 3.0), (1.0, 3.2), (2.0, 2.0), (1.0, 3.1)]) == pytest.approx(3.05)
    # Both models 10x slower on the busy frames: the ratio does not move.
    quiet_and_busy = [(1.0, 1.2), (10.0, 12.0), (1.0, 1.2), (10.0, 12.0), (10.0, 12.0)]
    assert median_ratio(quiet_and_busy) == pytest.approx(1.2)


def test_the_median_ratio_needs_its_pairs_and_skips_a_clock_that_did_not_tick() -> None:
    assert median_ratio([]) is None
    assert median_ratio([(0.0, 5.0)]) is None
    assert median_ratio([(0.0, 5.0), (2.0, 4.0)]) == pytest.approx(2.0)
    assert median_ratio([(1.0, 1.0)] * 4, min_pairs=5) is None
    assert median_ratio([(1.0, 1.0)] * 5, min_pairs=5) == pytest.approx(1.0)


def test_preemptions_of_one_side_only_leave_the_median_of_an_equal_model_near_one() -> None:
    """A CPU hog: each inference, old or new, is preempted for 5-40 ms with probability 0.3."""
    rng = random.Random(7)

    def busy(ms: float) -> float:
        return ms + (rng.uniform(5.0, 40.0) if rng.random() < 0.3 else 0.0)

    timed = [PairedTiming(i * 0.5, busy(1.0), busy(1.0)) for i in range(120)]
    ratio = judged_ratio(timed, 60.0)
    assert ratio is not None
    assert ratio < 1.5  # the bar is 3: a healthy model stays far from it
    slower = [PairedTiming(i * 0.5, busy(1.0), busy(4.0)) for i in range(120)]
    slow_ratio = judged_ratio(slower, 60.0)
    assert slow_ratio is not None
    assert slow_ratio > 3.0  # a model four times as costly still crosses it


def test_a_model_slow_from_the_start_is_judged_on_the_whole_window() -> None:
    assert judged_ratio(pairs([4.0] * 120), 60.0) == pytest.approx(4.0)
    assert judged_ratio(pairs([1.0] * 120), 60.0) == pytest.approx(1.0)


def test_a_model_that_turns_slow_after_a_third_of_the_window_is_judged_slow() -> None:
    # 20 s fast, then 40 s four times slower: the majority of both the window and its latter half.
    assert judged_ratio(pairs([1.0] * 40 + [4.0] * 80), 60.0) == pytest.approx(4.0)


def test_a_model_that_turns_slow_at_two_thirds_is_judged_on_the_latter_half() -> None:
    # 40 s fast, then 20 s slow: a third of the window (whole median 1.0), two thirds of its latter half.
    timed = pairs([1.0] * 80 + [4.0] * 40)
    assert median_ratio((p.old_ms, p.new_ms) for p in timed) == pytest.approx(1.0)
    assert judged_ratio(timed, 60.0) == pytest.approx(4.0)


def test_a_slowdown_in_the_last_fifth_only_is_too_short_to_judge_on_latency() -> None:
    assert judged_ratio(pairs([1.0] * 96 + [4.0] * 24), 60.0) == pytest.approx(1.0)


def test_a_slow_start_that_recovers_is_not_held_against_the_model() -> None:
    # A cold cache: the first 10 s four times slower, then as fast as the old model.
    assert judged_ratio(pairs([4.0] * 20 + [1.0] * 100), 60.0) == pytest.approx(1.0)


def test_a_faster_model_is_judged_on_its_whole_window_ratio() -> None:
    assert judged_ratio(pairs([0.5] * 120), 60.0) == pytest.approx(0.5)


def test_too_few_pairs_give_no_ratio_and_a_half_without_them_is_left_out() -> None:
    assert judged_ratio([], 60.0) is None
    assert judged_ratio(pairs([9.0] * (MIN_PAIRS - 1)), 60.0) is None
    # Five pairs, all in the first half: the whole window's median, the latter half has none.
    early = pairs([2.0] * MIN_PAIRS, every_s=1.0)
    assert judged_ratio(early, 60.0) == pytest.approx(2.0)


def test_pairs_alternate_which_model_goes_first() -> None:
    assert [old_first(i) for i in range(4)] == [True, False, True, False]


def test_a_pair_compares_cpu_times_when_both_runs_were_on_the_calling_thread() -> None:
    # The same runs: 0.4 and 1.4 ms of work, and 5 ms more of the wall clock each spent waiting.
    old, new = InferenceTime(5.4, cpu_ms=0.4), InferenceTime(6.4, cpu_ms=1.4)
    assert compared_times(old, new) == (0.4, 1.4)


def test_a_pair_falls_back_to_wall_times_unless_both_sides_have_cpu_times() -> None:
    assert compared_times(InferenceTime(2.0, cpu_ms=0.4), InferenceTime(8.0)) == (2.0, 8.0)
    assert compared_times(InferenceTime(2.0), InferenceTime(8.0, cpu_ms=1.4)) == (2.0, 8.0)
    # A thread clock that did not tick says nothing: the wall clock still does.
    assert compared_times(InferenceTime(2.0, cpu_ms=0.0), InferenceTime(8.0, cpu_ms=1.4)) == (2.0, 8.0)
