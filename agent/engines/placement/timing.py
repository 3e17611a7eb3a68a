"""Time loaded engines on real frames: the measuring half of placement by measurement.

:func:`time_runner` runs one :class:`~agent.backends.base.Runner` over the given preprocessed frames
(cycled) for a fixed wall time after a short warm-up, one frame per call as the frame path does, and
reports frames per second and the median latency. :func:`time_together` runs several engines at once
the way a multi-engine slot does (one worker thread per engine, all taking frames from one shared
queue) and reports the frames per second of the set and the frames each engine ran. The decision is pure
(:mod:`agent.engines.placement.choice`); this is its thin imperative shell. No figure is asserted in
tests: speed figures come from ``bench/``.
"""

from __future__ import annotations

import queue
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
    feeds = _feeds(runner, frames)
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


def _feeds(runner: Runner, frames: Sequence[npt.NDArray[Any]]) -> list[dict[str, npt.NDArray[Any]]]:
    """``frames`` as feeds of ``runner``'s first input (a batch axis added where it lacks one)."""
    name, rank = runner.inputs[0].name, len(runner.inputs[0].shape)
    return [{name: f if f.ndim == rank else f[np.newaxis]} for f in frames]


@dataclass(frozen=True)
class CombinedTiming:
    """How fast several engines ran together: the frames each inferred and the wall seconds."""

    engine_frames: tuple[int, ...]
    seconds: float

    @property
    def frames(self) -> int:
        return sum(self.engine_frames)

    @property
    def fps(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else 0.0


#: Frames waiting in the shared queue per engine: enough that no worker waits on the feeder, few
#: enough that the feeder stops promptly at the deadline (as the slot's bounded inference queue).
QUEUE_PER_ENGINE = 2

#: How long past its time a timing may run before a worker stuck in an engine fails it.
STUCK_GRACE_S = 30.0


def time_together(
    runners: Sequence[Runner],
    frames: Sequence[npt.NDArray[Any]],
    *,
    seconds: float,
    min_calls: int = 5,
    cancel: threading.Event | None = None,
) -> CombinedTiming:
    """Run ``runners`` at once on ``frames`` (cycled) for ``seconds``: one worker thread per runner,
    each taking the next frame from one shared queue, one frame per call, as the multi-engine slot
    serves a stream. Each runner is warmed up first (alone). ``engine_frames[i]`` is what runner *i*
    inferred; they sum to the frames fed. At least ``min_calls`` frames in all, whatever the time.

    Raises BuildError when there are no runners or frames, an engine fails (naming it by index),
    an engine is stuck past ``seconds`` + :data:`STUCK_GRACE_S`, or ``cancel`` is set.
    """
    if not runners:
        raise BuildError("no engines to time together")
    if not frames:
        raise BuildError("no frames to time the engines on")
    feeds = [_feeds(runner, frames) for runner in runners]
    try:
        for runner, own in zip(runners, feeds, strict=True):
            for i in range(WARMUP_CALLS):
                runner.infer(own[i % len(own)])
    except Exception as exc:
        raise BuildError(f"an engine failed while being warmed up to be timed together: {exc}") from exc
    work: queue.Queue[int | None] = queue.Queue(maxsize=QUEUE_PER_ENGINE * len(runners))
    done = [0] * len(runners)
    errors: list[str] = []
    stop = threading.Event()

    def serve(index: int) -> None:
        runner, own = runners[index], feeds[index]
        while True:
            try:
                item = work.get(timeout=0.1)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            if item is None:
                return
            try:
                runner.infer(own[item % len(own)])
            except Exception as exc:  # noqa: BLE001 - reported as this candidate set's failure below
                errors.append(f"engine {index} failed while being timed together: {exc}")
                stop.set()
                return
            done[index] += 1

    workers = [
        threading.Thread(target=serve, args=(i,), name=f"time-together-{i}", daemon=True)
        for i in range(len(runners))
    ]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    deadline = started + seconds
    fed = 0
    while not stop.is_set() and (fed < min_calls or time.perf_counter() < deadline):
        if cancel is not None and cancel.is_set():
            stop.set()
            break
        try:
            work.put(fed, timeout=0.1)
        except queue.Full:
            continue
        fed += 1
    try:
        for _ in workers if not stop.is_set() else ():
            # Every frame queued before the end marks is served: the frames counted are those fed.
            work.put(None, timeout=STUCK_GRACE_S)
    except queue.Full:
        stop.set()  # the workers stopped taking frames: stuck, reported below
    for worker in workers:
        worker.join(timeout=max(0.0, deadline + STUCK_GRACE_S - time.perf_counter()))
    wall = time.perf_counter() - started
    stop.set()
    if errors:
        raise BuildError(errors[0])
    if cancel is not None and cancel.is_set():
        raise BuildError("timing cancelled: the agent is stopping or the job was superseded")
    if any(worker.is_alive() for worker in workers):
        raise BuildError(f"an engine is stuck: still running {wall:.0f} s into a {seconds:g} s timing")
    return CombinedTiming(engine_frames=tuple(done), seconds=wall)
