"""A shadow run: the candidate model on sampled live frames beside the serving one, off the frame path.

The run samples the slot's latest captured frame at most ``sample_fps`` times a second (a frame it
has already seen is skipped), runs it through the serving model (leased, like a batch) and through
the candidate, one after the other on this thread (which one first alternates), and feeds the pair to a
:class:`~agent.runtime.slots.agreement.ShadowTally` until the tally decides, ``frames`` were compared, or
``timeout_s`` passes. The frame path never waits for it: it only reads a reference the capture
thread keeps anyway (``SlotPipeline.last_image``), and the extra inference load is bounded by the
sample rate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.backends.base import Runner
from agent.camera.preprocess import preprocess
from agent.protocol.delivery_errors import JobCancelledError
from agent.protocol.proving import ShadowSpec
from agent.protocol.results import Prediction
from agent.runtime.slots.agreement import ShadowBar, ShadowTally, Verdict, frame_agreement, topk_overlap
from agent.runtime.slots.evidence import DisagreementHeap
from agent.runtime.slots.latency import InferenceTime, compared_times, old_first
from agent.runtime.slots.loaded import LoadedModel
from agent.runtime.slots.pair_runners import PairRunners
from agent.runtime.slots.slot import ModelSlot

log = structlog.get_logger(__name__)

#: Figures are published at most this often while the run goes on.
_REPORT_EVERY_S = 1.0


def run_shadow(
    slot: ModelSlot,
    candidate: LoadedModel,
    spec: ShadowSpec,
    *,
    latest_frame: Callable[[], npt.NDArray[np.uint8] | None],
    cancel: threading.Event,
    report: Callable[[ShadowTally], None],
    evidence: DisagreementHeap | None = None,
) -> tuple[ShadowTally, Verdict | None]:
    """Compare ``candidate`` with the slot's serving model; return the tally and its verdict.

    Each compared frame is offered to ``evidence`` (the frames of lowest agreement, by reference).

    The verdict is None only when no frame could be compared before the timeout (no live frames).
    Raises :class:`JobCancelledError` as soon as ``cancel`` is set.
    """
    tally = ShadowTally(ShadowBar(spec.frames, spec.min_agreement, spec.max_latency_ratio))
    gap = 1.0 / spec.sample_fps
    deadline = time.monotonic() + spec.timeout_s
    last_report = time.monotonic()
    seen: npt.NDArray[np.uint8] | None = None
    runners = PairRunners()
    try:
        while True:
            if cancel.wait(gap):
                raise JobCancelledError("shadow run cancelled")
            timed_out = time.monotonic() >= deadline
            image = latest_frame()
            if image is not None and image is not seen:
                seen = image
                _compare(slot, candidate, image, tally, evidence, runners=runners)
            verdict = tally.verdict(final=timed_out)
            if time.monotonic() - last_report >= _REPORT_EVERY_S and verdict is None:
                last_report = time.monotonic()
                report(tally)
            if verdict is not None or timed_out:
                log.info("shadow.done", slot=slot.name, verdict=verdict, **tally.figures())
                return tally, verdict
    finally:
        runners.close()


def _compare(
    slot: ModelSlot,
    candidate: LoadedModel,
    image: npt.NDArray[np.uint8],
    tally: ShadowTally,
    evidence: DisagreementHeap | None,
    *,
    runners: PairRunners,
) -> None:
    with slot.lease() as serving:
        if serving is None:
            return
        pair = predict_pair(serving, candidate, image, tally.frames + tally.bad_outputs, runners)
    old, new, finite = pair.old, pair.new, pair.finite
    if not finite:
        tally.bad_outputs += 1
        if evidence is not None:
            evidence.offer(0.0, image, old, new, note="candidate outputs NaN or Inf")
        return
    top5 = topk_overlap(old.classes, new.classes or []) if old.classes is not None else None
    agreement = frame_agreement(old, new)
    tally.add(agreement, pair.old_ms, pair.new_ms, top5=top5)
    if evidence is not None:
        evidence.offer(agreement, image, old, new)


@dataclass(frozen=True)
class PredictedPair:
    """Both models on one frame: their predictions, whether the new one's outputs were finite, and
    the times their latency ratio compares (:func:`~agent.runtime.slots.latency.compared_times`)."""

    old: Prediction
    new: Prediction
    finite: bool
    old_ms: float
    new_ms: float


def predict_pair(
    old: LoadedModel, new: LoadedModel, image: npt.NDArray[np.uint8], index: int, runners: PairRunners
) -> PredictedPair:
    """Both models on ``image`` back to back, which one first alternating with the pair's ``index``,
    each on the runner ``runners`` gives it."""
    old_runner, new_runner = runners(old), runners(new)
    if old_first(index):
        old_out, old_time, _ = predict(old, image, old_runner)
        new_out, new_time, finite = predict(new, image, new_runner)
    else:
        new_out, new_time, finite = predict(new, image, new_runner)
        old_out, old_time, _ = predict(old, image, old_runner)
    return PredictedPair(old_out, new_out, finite, *compared_times(old_time, new_time))


def predict(
    model: LoadedModel, image: npt.NDArray[np.uint8], runner: Runner | None = None
) -> tuple[Prediction, InferenceTime, bool]:
    """The model's prediction on one frame (on ``runner``, by default its own), its inference time,
    and whether outputs were finite."""
    runner = runner or model.runner
    tensor, letterbox = preprocess(image, model.preprocess)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    outputs: dict[str, Any] = runner.infer({model.input_name: tensor[np.newaxis]})
    wall_ms = (time.perf_counter() - t0) * 1000.0
    cpu_ms = (time.thread_time() - cpu0) * 1000.0 if runner.runs_on_caller else None
    timed = InferenceTime(wall_ms, cpu_ms)
    finite = all(a.dtype.kind != "f" or bool(np.isfinite(a).all()) for a in outputs.values())
    if not finite:  # postprocessing NaN scores means nothing (and may raise): the frame counts as bad
        return Prediction(), timed, False
    prediction = model.postprocessor({name: array[0] for name, array in outputs.items()}, letterbox)
    return prediction, timed, finite
