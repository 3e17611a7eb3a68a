"""The simulator's pull counters (agent/fleetsim/device.py ``add_pull_counters``), which
bench/fleet.py sums over the fleet: counts add up, maxima stay maxima."""

from __future__ import annotations

import collections

from agent.delivery.transfer.pull import PullStats
from agent.fleetsim.device import add_pull_counters


def test_counts_add_up_over_pulls_and_the_largest_values_stay_the_largest() -> None:
    first = PullStats(requested_chunks=21, timeouts=3, wait_notices=1, server_wait_ms=40_000, timeout_ms=5000)
    second = PullStats(requested_chunks=25, timeouts=0, busy_notices=2, server_wait_ms=9_000, timeout_ms=7000)
    totals: collections.Counter[str] = collections.Counter()
    for stats in (first, second):
        add_pull_counters(totals, stats.as_dict())

    assert (totals["requested_chunks"], totals["timeouts"]) == (46, 3)
    assert (totals["wait_notices"], totals["busy_notices"]) == (1, 2)
    assert (totals["server_wait_ms"], totals["timeout_ms"]) == (40_000, 7000)
