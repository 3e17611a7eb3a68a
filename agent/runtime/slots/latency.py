"""Latency judged like with like: the new model against the old one on the same frames, at the same moments.

A busy machine (other containers, a hot SoC throttling, a second camera) slows every inference, the
old model's as much as the new one's. A latency measured before a swap and one measured after it
therefore compare the machine's load as much as the models. Here both models run on the same frame
back to back (which one goes first alternates), so both meet the same load, and the per-frame ratio
``new_ms / old_ms`` cancels it. The median of those ratios also ignores the frames on which the
scheduler preempted only one of the two (a preemption makes one ratio large or small, not the median).

Load the pairing cannot cancel is what lands on both runs of a pair: a machine so busy that most runs
are preempted, and the wait for the GIL once a run ends while the agent's other threads hold it. Each
adds milliseconds to both times and so pulls every ratio towards 1 (a model four times as costly was
judged 2.6 under four busy processes on two cores). Where a run executes wholly on the calling thread
(ONNX Runtime on the CPU with one intra-op thread: what the agent picks for small models, and the
copy :mod:`agent.runtime.slots.pair_runners` makes of a model with a pool) the pair holds that
thread's CPU time instead, which neither counts (:func:`compared_times`).

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
class InferenceTime:
    """One inference: its wall time, and the calling thread's CPU time when the whole run executed on
    that thread (``Runner.runs_on_caller``; None otherwise)."""

    wall_ms: float
    cpu_ms: float | None = None


def compared_times(old: InferenceTime, new: InferenceTime) -> tuple[float, float]:
    """The two times a latency ratio compares: both CPU times when both runs executed on the calling
    thread, else both wall times.

    Wall time counts whatever else happened meanwhile: the preemptions by other processes and, after
    the run, the wait for the GIL while the agent's other threads hold it. That wait is added to both
    models alike and so pulls every ratio towards 1; the thread's CPU time leaves it out.
    """
    if old.cpu_ms is not None and new.cpu_ms is not None and old.cpu_ms > 0.0:
        return old.cpu_ms, new.cpu_ms
    return old.wall_ms, new.wall_ms


@dataclass(frozen=True)
class PairedTiming:
    """Both models' inference time on one frame, timed back to back ``at_s`` seconds into the window
    (the times :func:`compared_times` chose)."""

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
