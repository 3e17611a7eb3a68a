"""Time a loaded engine on real frames: the measuring half of placement by measurement.

:func:`time_runner` runs one :class:`~agent.backends.base.Runner` over the given preprocessed frames
(cycled) for a fixed wall time after a short warm-up, one frame per call as the frame path does, and
reports frames per second and the median latency. The decision is pure
(:mod:`agent.engines.placement_choice`); this is its thin imperative shell. No figure is asserted in
tests: speed figures come from ``bench/``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.backends.base import Runner
from agent.errors import BuildError

#: Calls before the clock starts: the first inferences allocate and (TensorRT, CUDA) autotune.
WARMUP_CALLS = 3


@dataclass(frozen=True)
class Timing:
    """How fast one engine ran: frames inferred, wall seconds, and per-call latencies."""

    frames: int
    seconds: float
    p50_ms: float
    p95_ms: float

    @property
    def fps(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else 0.0


def time_runner(
    runner: Runner,
    frames: Sequence[npt.NDArray[Any]],
    *,
    seconds: float,
    min_calls: int = 5,
    cancel: threading.Event | None = None,
) -> Timing:
    """Run ``runner`` on ``frames`` (each ``[1, ...]`` or ``[...]`` for the first input) for ``seconds``.

    At least ``min_calls`` timed calls, whatever the time. Raises BuildError when there are no frames
    or the engine fails on them (the candidate is then dropped, with that reason).
    """
    if not frames:
        raise BuildError("no frames to time the engine on")
    name = runner.inputs[0].name
    feeds = [{name: f if f.ndim == len(runner.inputs[0].shape) else f[np.newaxis]} for f in frames]
    cancelled = False
    try:
        for i in range(WARMUP_CALLS):
            runner.infer(feeds[i % len(feeds)])
        latencies: list[float] = []
        started = time.perf_counter()
        deadline = started + seconds
        i = 0
        while len(latencies) < min_calls or time.perf_counter() < deadline:
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            t0 = time.perf_counter()
            runner.infer(feeds[i % len(feeds)])
            latencies.append(time.perf_counter() - t0)
            i += 1
        wall = time.perf_counter() - started
    except Exception as exc:
        raise BuildError(f"the engine failed while being timed: {exc}") from exc
    if cancelled:
        raise BuildError("timing cancelled: the agent is stopping or the job was superseded")
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return Timing(
        frames=len(latencies),
        seconds=wall,
        p50_ms=statistics.median(ordered) * 1000.0,
        p95_ms=p95 * 1000.0,
    )
