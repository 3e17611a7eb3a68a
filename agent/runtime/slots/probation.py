"""Probation: the new model serves, watched against the old model's baseline, until it passes or fails.

:func:`run_probation` checks twice a second: NaN/Inf outputs and inference errors end it at once, the
ratios (fps per stream, latency, drops, the classifier's class mix) are judged when ``probation_s``
is over (:func:`agent.runtime.slots.health.judge`). At every check it also times the old model (kept
loaded for the swap back) and the new one on the latest live frame, back to back: the latency is
judged on those pairs, so a machine busy with other work slows both sides alike
(:mod:`agent.runtime.slots.latency`). An operator ``rollback`` during it ends it at once, and so does
the job's cancel event (superseded, agent stopping).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import structlog

from agent.errors import AgentError
from agent.protocol.messages import FailedFigure, ProbationFigures
from agent.protocol.proving import ProbationSpec
from agent.runtime.slots.agreement import total_variation
from agent.runtime.slots.health import HealthFigures, judge
from agent.runtime.slots.latency import PairedTiming, judged_ratio
from agent.runtime.slots.loaded import LoadedModel
from agent.runtime.slots.pair_runners import PairRunners
from agent.runtime.slots.shadow import predict_pair

log = structlog.get_logger(__name__)

_CHECK_EVERY_S = 0.5
#: Live frames remembered during a probation (references, one per check), for a rollback's evidence.
_FRAMES_KEPT = 12
_REPORT_EVERY_S = 5.0
#: Paired timings kept (one per check): an hour of probation.
_PAIRS_KEPT = 7200

Outcome = Literal["healthy", "unhealthy", "operator_rollback", "cancelled"]


@dataclass
class ProbationRun:
    """One slot's probation in progress: what telemetry and the ``rollback`` command see of it."""

    slot: str
    probation_s: float
    started: float
    baseline: HealthFigures
    figures: ProbationFigures | None = None
    #: Set by the ``rollback`` command: the probation ends at once, swapping back.
    rollback: threading.Event = field(default_factory=threading.Event)
    #: Set once the new model is out (swapped back) or in for good.
    done: threading.Event = field(default_factory=threading.Event)
    #: The latest live frames seen at the checks (references the capture owns, never copies): what a
    #: rollback's evidence compares both models on.
    frames: deque[npt.NDArray[np.uint8]] = field(default_factory=lambda: deque(maxlen=_FRAMES_KEPT))
    #: Both models timed on the same live frame, one pair per check: what the latency is judged on.
    pairs: deque[PairedTiming] = field(default_factory=lambda: deque(maxlen=_PAIRS_KEPT))

    def remember(self, image: npt.NDArray[np.uint8] | None) -> None:
        """Keep ``image`` among the latest frames (a frame already kept is skipped)."""
        if image is not None and (not self.frames or self.frames[-1] is not image):
            self.frames.append(image)

    def end_by_operator(self, timeout: float) -> bool:
        """The ``rollback`` command: end the probation now; True once swapped back (False: not running)."""
        if self.done.is_set():
            return False
        self.rollback.set()
        self.done.wait(timeout)
        return True

    def telemetry(self) -> dict[str, float]:
        """Flat per-slot figures for ``up/telemetry`` (``probation.*`` keys under the slot's prefix)."""
        out = {"probation.active": 1.0, "probation.elapsed_s": round(time.monotonic() - self.started, 3)}
        if self.figures is not None:
            out.update({f"probation.current.{k}": v for k, v in self.figures.current.items()})
            out.update({f"probation.baseline.{k}": v for k, v in self.figures.baseline.items()})
        return out


def run_probation(
    run: ProbationRun,
    model: LoadedModel,
    bars: ProbationSpec,
    cancel: threading.Event,
    report: Callable[[ProbationFigures], None],
    *,
    latest_frame: Callable[[], npt.NDArray[np.uint8] | None] | None = None,
    previous: LoadedModel | None = None,
) -> Outcome:
    """Watch ``model`` (already serving) until the probation ends; return how it ended.

    ``previous`` (the model it replaced, still loaded) is timed beside it on the latest frame at each
    check. ``run.figures`` holds the last figures (with ``failed`` set when a figure crossed its bar).
    """
    model.health.watch_outputs = True
    last_report = time.monotonic()
    runners = PairRunners()
    try:
        while True:
            if run.rollback.wait(_CHECK_EVERY_S):
                _measure(run, model, None)
                return "operator_rollback"
            if cancel.is_set():
                return "cancelled"
            image = latest_frame() if latest_frame is not None else None
            run.remember(image)
            if previous is not None and image is not None:
                _time_pair(run, previous, model, image, runners)
            final = time.monotonic() - run.started >= run.probation_s
            current = model.health.figures(run.started, time.monotonic())
            latency = judged_ratio(list(run.pairs), run.probation_s)
            failed = judge(run.baseline, current, bars, final=final, latency_ratio=latency)
            _measure(run, model, failed, current)
            if failed is not None:
                log.error(
                    "probation.unhealthy",
                    slot=run.slot,
                    figure=failed.figure,
                    value=failed.value,
                    bar=failed.bar,
                )
                return "unhealthy"
            if final:
                return "healthy"
            if time.monotonic() - last_report >= _REPORT_EVERY_S:
                last_report = time.monotonic()
                assert run.figures is not None
                report(run.figures)
    finally:
        model.health.watch_outputs = False
        runners.close()


def _time_pair(
    run: ProbationRun,
    old: LoadedModel,
    new: LoadedModel,
    image: npt.NDArray[np.uint8],
    runners: PairRunners,
) -> None:
    """Both models on ``image``, back to back (the order alternating), kept as one pair."""
    at_s = time.monotonic() - run.started
    try:
        pair = predict_pair(old, new, image, len(run.pairs), runners)
    except AgentError as exc:
        # The frame path counts the new model's errors; a pair that failed is only not a pair.
        log.warning("probation.pair_failed", slot=run.slot, error=str(exc))
        return
    run.pairs.append(PairedTiming(at_s, pair.old_ms, pair.new_ms))


def _measure(
    run: ProbationRun, model: LoadedModel, failed: FailedFigure | None, current: HealthFigures | None = None
) -> None:
    if current is None:
        current = model.health.figures(run.started, time.monotonic())
    now = current.flat()
    shift = total_variation(run.baseline.classes, current.classes)
    if shift is not None:
        now["class_shift"] = round(shift, 4)
    latency = judged_ratio(list(run.pairs), run.probation_s)
    if latency is not None:
        now["latency_ratio"] = round(latency, 4)
    now["latency_pairs"] = float(len(run.pairs))
    run.figures = ProbationFigures(
        elapsed_s=round(time.monotonic() - run.started, 3),
        probation_s=run.probation_s,
        baseline=run.baseline.flat(),
        current=now,
        failed=failed,
    )
