"""Latency judged like with like: the new model against the old one on the same frames, at the same moments.

A busy machine (other containers, a hot SoC throttling, a second camera) slows every inference, the
old model's as much as the new one's. A latency measured before a swap and one measured after it
therefore compare the machine's load as much as the models. Here both models run on the same frame
back to back (which one goes first alternates), so both meet the same load, and the per-frame ratio
``new_ms / old_ms`` cancels it. The median of those ratios also ignores the frames on which the
scheduler preempted only one of the two (a preemption makes one ratio large or small, not the median).

The probation (:mod:`agent.runtime.slots.probation`) judges :func:`judged_ratio`: the median over
the whole probation and over its latter half, whichever is larger, so a model that turns slow late
and stays slow is judged on the stretch where it is slow. The shadow uses :func:`median_ratio`.
All functions here are pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Fewest pairs the probation takes a ratio over: fewer tell more about a preemption than a model.
MIN_PAIRS = 5


@dataclass(frozen=True)
class PairedTiming:
    """Both models' inference time on one frame, timed back to back ``at_s`` seconds into the window."""

    at_s: float
    old_ms: float
    new_ms: float


def median_ratio(pairs: Iterable[tuple[float, float]], *, min_pairs: int = 1) -> float | None:
    """The median over ``(old_ms, new_ms)`` pairs of ``new_ms / old_ms``; None under ``min_pairs`` pairs.

    A pair whose old time is not positive (a clock that did not tick) says nothing and is skipped.
    """
    ratios = [new / old for old, new in pairs if old > 0.0]
    if not ratios or len(ratios) < min_pairs:
        return None
    return float(statistics.median(ratios))


def judged_ratio(pairs: Sequence[PairedTiming], window_s: float) -> float | None:
    """The ratio a probation of ``window_s`` seconds judges: the larger of the whole window's median
    ratio and its latter half's, each over at least :data:`MIN_PAIRS` pairs; None when neither has them.

    A slowdown that began before three quarters of the window and lasted to its end is the majority
    of the latter half; one shorter than that is not judged on latency (its fps and drops still are).
    """
    whole = median_ratio(((p.old_ms, p.new_ms) for p in pairs), min_pairs=MIN_PAIRS)
    half = window_s / 2.0
    late = median_ratio(((p.old_ms, p.new_ms) for p in pairs if p.at_s >= half), min_pairs=MIN_PAIRS)
    found = [r for r in (whole, late) if r is not None]
    return max(found) if found else None


def old_first(index: int) -> bool:
    """Whether pair ``index`` times the old model first: alternating, so neither always meets the
    caches (and the scheduler's time slice) the other one left."""
    return index % 2 == 0
