"""The re-request timer (agent/delivery/transfer/rto.py): RFC 6298's estimate, the floor and the ceiling."""

from __future__ import annotations

import pytest

from agent.delivery.transfer.rto import (
    BUSY_SPREAD,
    WAIT_MARGIN,
    RetransmitTimer,
    due_after_wait,
    resume_after_busy,
)


@pytest.mark.parametrize(
    ("samples", "floor", "expected"),
    [
        ([], 5.0, 5.0),  # nothing measured: the configured timeout
        ([0.05, 0.06, 0.05], 5.0, 5.0),  # fast answers never shorten it below the floor
        ([8.0], 5.0, 8.0 + 4 * 4.0),  # first sample: srtt = R, rttvar = R / 2
        ([8.0, 8.0], 5.0, 8.0 + 4 * 3.0),  # the variation shrinks as answers agree
        ([60.0, 80.0], 5.0, 60.0),  # never above the ceiling
    ],
)
def test_the_timeout_follows_the_measured_round_trips(
    samples: list[float], floor: float, expected: float
) -> None:
    timer = RetransmitTimer(floor_s=floor)
    for rtt in samples:
        timer.sample(rtt)
    assert timer.timeout == pytest.approx(expected)
    assert timer.samples == len(samples)


def test_the_estimate_moves_an_eighth_of_the_way_per_sample() -> None:
    timer = RetransmitTimer(floor_s=0.01)
    timer.sample(1.0)
    timer.sample(2.0)
    assert timer.srtt == pytest.approx(1.0 + (2.0 - 1.0) / 8)
    assert timer.rttvar == pytest.approx(0.75 * 0.5 + 0.25 * 1.0)


def test_a_negative_sample_counts_as_zero() -> None:
    timer = RetransmitTimer(floor_s=0.5)
    timer.sample(-1.0)
    assert timer.srtt == 0.0
    assert timer.timeout == 0.5


def test_a_wait_the_server_names_comes_before_the_usual_timeout() -> None:
    """Chunks queued for 4 s behind others are asked for again only after the stretched wait and then
    the timeout a reply needs once they leave."""
    assert due_after_wait(100.0, 4.0, 5.0) == pytest.approx(100.0 + WAIT_MARGIN * 4.0 + 5.0)
    assert due_after_wait(100.0, -1.0, 5.0) == pytest.approx(105.0)


def test_devices_told_busy_together_come_back_spread_out() -> None:
    times = [resume_after_busy(0.0, 10.0, spread) for spread in (0.0, 0.5, 0.999)]
    assert times[0] == pytest.approx(10.0)
    assert times == sorted(times)
    assert times[-1] == pytest.approx(10.0 * (1 + BUSY_SPREAD * 0.999))
