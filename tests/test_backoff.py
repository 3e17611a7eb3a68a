"""Reconnect delays: bounded, growing, and spread (a fleet must not reconnect in lockstep)."""

from __future__ import annotations

import random
import statistics

import pytest

from agent.backoff import reconnect_delay


def test_delays_stay_within_bounds() -> None:
    rng = random.Random(1)
    for attempt in range(0, 200):
        delay = reconnect_delay(attempt, 1.0, 60.0, rng)
        assert 1.0 <= delay <= 60.0


def test_window_doubles_until_the_cap() -> None:
    rng = random.Random(2)
    for attempt, ceiling in [(0, 2.0), (1, 4.0), (2, 8.0), (5, 60.0), (50, 60.0)]:
        samples = [reconnect_delay(attempt, 1.0, 60.0, rng) for _ in range(2000)]
        assert max(samples) <= ceiling
        # Full jitter: the draws cover most of [min, ceiling], not one point.
        assert max(samples) - min(samples) > 0.8 * (ceiling - 1.0)


def test_a_fleet_spreads_out_on_the_first_retry() -> None:
    """1000 devices that lost the broker at the same moment do not come back at the same moment."""
    rng = random.Random(3)
    delays = [reconnect_delay(0, 1.0, 60.0, rng) for _ in range(1000)]
    assert statistics.pstdev(delays) > 0.2
    buckets = {int(d * 10) for d in delays}  # 100 ms buckets over [1, 2] s
    assert len(buckets) >= 10


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert reconnect_delay(10_000, 0.5, 30.0, random.Random(4)) <= 30.0


@pytest.mark.parametrize(("attempt", "lo", "hi"), [(-1, 1.0, 2.0), (0, 0.0, 2.0), (0, 3.0, 2.0)])
def test_invalid_arguments_are_refused(attempt: int, lo: float, hi: float) -> None:
    with pytest.raises(ValueError):
        reconnect_delay(attempt, lo, hi)
