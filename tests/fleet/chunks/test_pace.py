"""The chunk server's pacing decisions (agent/fleet/chunks/pace.py): the rate it measures, the notices."""

from __future__ import annotations

import pytest

from agent.fleet.chunks.pace import ServeRate, busy_notice, wait_notice
from agent.protocol.chunks import MAX_NOTICE_MS, ChunkNotice


def test_the_rate_is_the_acknowledgements_over_the_recent_busy_time() -> None:
    rate = ServeRate()
    assert rate.per_second is None
    for step in range(11):  # 100 acknowledged a second, sampled every 0.1 s for 1 s
        rate.sample(100.0 + step * 0.1, step * 10)
    assert rate.per_second == pytest.approx(100.0)


def test_a_burst_shorter_than_half_a_second_gives_no_rate_yet() -> None:
    rate = ServeRate()
    rate.sample(10.0, 0)
    rate.sample(10.2, 256)  # the first chunks of a wave leave at once
    assert rate.per_second is None


def test_after_a_pause_the_last_busy_periods_rate_holds_until_the_new_one_is_measured() -> None:
    rate = ServeRate()
    for step in range(11):
        rate.sample(step * 0.1, step * 5)  # 50 a second
    rate.sample(30.0, 60)  # a new wave, 29 s later: the pause is no slow rate
    assert rate.per_second == pytest.approx(50.0)
    for step in range(1, 11):
        rate.sample(30.0 + step * 0.1, 60 + step * 20)  # now 200 a second
    assert rate.per_second == pytest.approx(200.0)


def test_old_samples_leave_the_window() -> None:
    rate = ServeRate()
    for step in range(201):  # 20 s: 10 a second, then 100 a second for the last 10 s
        now = step * 0.1
        done = step if now <= 10 else 100 + (step - 100) * 10
        rate.sample(now, done)
    assert rate.per_second == pytest.approx(100.0, rel=0.05)


@pytest.mark.parametrize(
    ("ahead", "own", "per_second", "timeout_ms", "expected"),
    [
        (400, 20, 100.0, 5000, ChunkNotice(wait_ms=4200, ahead=400)),  # 4.2 s: past half the timeout
        (100, 20, 100.0, 5000, None),  # 1.2 s: the device waits that long anyway
        (400, 20, None, 5000, None),  # no rate measured: nothing to promise
        (10**9, 1, 1.0, 5000, ChunkNotice(wait_ms=MAX_NOTICE_MS, ahead=10**9)),  # capped
    ],
)
def test_a_wait_notice_goes_out_when_the_line_is_longer_than_half_the_devices_timeout(
    ahead: int, own: int, per_second: float | None, timeout_ms: int, expected: ChunkNotice | None
) -> None:
    assert wait_notice(ahead=ahead, own=own, per_second=per_second, timeout_ms=timeout_ms) == expected


@pytest.mark.parametrize(
    ("waiting", "per_second", "retry_ms"),
    [
        (3000, 100.0, 30_000),  # come back when what waits is sent
        (10, 100.0, 1_000),  # never sooner than a second
        (10**6, 100.0, 60_000),  # never later than a minute
        (3000, None, 5_000),  # no rate measured: a default
    ],
)
def test_a_busy_notice_names_when_the_line_has_room(
    waiting: int, per_second: float | None, retry_ms: int
) -> None:
    assert busy_notice(waiting=waiting, per_second=per_second) == ChunkNotice(retry_ms=retry_ms)
