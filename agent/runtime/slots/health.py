"""A model's live health on the frame path, and the probation's judgement of it against a baseline.

Every :class:`~agent.runtime.slots.loaded.LoadedModel` carries a :class:`ModelHealth`: per-second buckets
of what the frame path saw of it (frames published per stream, inference times, inference errors,
frames dropped while it served, NaN/Inf outputs, top-1 classes) over the last few minutes. The old
model's buckets before a swap are the baseline; the new model's since the swap are its probation
record. :func:`judge` (pure) compares two :class:`HealthFigures` with the manifest's bars.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from agent.protocol.messages import FailedFigure
from agent.protocol.proving import ProbationSpec
from agent.runtime.slots.agreement import total_variation

#: Buckets kept: the baseline reaches at most this far back.
_WINDOW_S = 3600
#: Inference times kept per second (a cap: a p99 needs no more, and memory stays bounded).
_TIMES_PER_BUCKET = 256


@dataclass
class _Bucket:
    second: int
    published: Counter[str] = field(default_factory=Counter)
    offered: Counter[str] = field(default_factory=Counter)
    infer_ms: list[float] = field(default_factory=list)
    errors: int = 0
    nan: int = 0
    dropped: int = 0
    classes: Counter[int] = field(default_factory=Counter)


@dataclass(frozen=True)
class HealthFigures:
    """One model's health over ``seconds``: what probation compares."""

    seconds: float
    fps: dict[str, float]
    p99_ms: float | None
    infer_errors: int
    nan_outputs: int
    dropped_share: float
    classes: dict[int, int]
    #: Frames per second the capture handed this model, per stream (what it could have published).
    offered_fps: dict[str, float] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """Flat numbers for the job status and telemetry (classes left out: a histogram, not a figure)."""
        out = {f"fps.{stream}": round(v, 3) for stream, v in self.fps.items()}
        out.update({f"offered_fps.{stream}": round(v, 3) for stream, v in self.offered_fps.items()})
        if self.p99_ms is not None:
            out["p99_ms"] = round(self.p99_ms, 3)
        out["infer_errors"] = float(self.infer_errors)
        out["nan_outputs"] = float(self.nan_outputs)
        out["dropped_share"] = round(self.dropped_share, 4)
        return out


class ModelHealth:
    """Per-second counts of one model's frame-path figures (cheap per frame: a lock and an increment)."""

    def __init__(self) -> None:
        self._buckets: deque[_Bucket] = deque()
        self._lock = threading.Lock()
        #: Set while the model is on probation: the inference stage then checks outputs for NaN/Inf
        #: (a cost the frame path pays only then).
        self.watch_outputs = False
        self.first_mono: float | None = None

    def _bucket(self, now: float) -> _Bucket:
        second = int(now)
        if not self._buckets or self._buckets[-1].second != second:
            if self.first_mono is None:
                self.first_mono = now
            self._buckets.append(_Bucket(second))
            while self._buckets and self._buckets[0].second < second - _WINDOW_S:
                self._buckets.popleft()
        return self._buckets[-1]

    def published(self, stream: str, top1: int | None = None) -> None:
        """A result of this model was published (``top1``: its best class, for classifiers)."""
        with self._lock:
            bucket = self._bucket(time.monotonic())
            bucket.published[stream] += 1
            if top1 is not None:
                bucket.classes[top1] += 1

    def offered(self, stream: str) -> None:
        """The capture handed this model a frame of ``stream`` (before any queue could drop it)."""
        with self._lock:
            self._bucket(time.monotonic()).offered[stream] += 1

    def inferred(self, infer_ms: float, *, nan_frames: int = 0) -> None:
        """One batch ran in ``infer_ms``; ``nan_frames`` of its frames had NaN/Inf outputs."""
        with self._lock:
            bucket = self._bucket(time.monotonic())
            if len(bucket.infer_ms) < _TIMES_PER_BUCKET:
                bucket.infer_ms.append(infer_ms)
            bucket.nan += nan_frames

    def failed(self, frames: int) -> None:
        """An inference call raised: ``frames`` lost."""
        with self._lock:
            self._bucket(time.monotonic()).errors += frames

    def dropped(self, frames: int = 1) -> None:
        """Frames dropped (queue full) while this model served."""
        with self._lock:
            self._bucket(time.monotonic()).dropped += frames

    def figures(self, since: float, until: float) -> HealthFigures:
        """Health between two ``time.monotonic()`` instants (whole seconds; at least one second long)."""
        start = int(max(since, self.first_mono if self.first_mono is not None else since))
        end = int(until)
        with self._lock:
            buckets = [b for b in self._buckets if start <= b.second <= end]
            published: Counter[str] = Counter()
            offered: Counter[str] = Counter()
            classes: Counter[int] = Counter()
            times: list[float] = []
            errors = nan = dropped = 0
            for b in buckets:
                published.update(b.published)
                offered.update(b.offered)
                classes.update(b.classes)
                times.extend(b.infer_ms)
                errors += b.errors
                nan += b.nan
                dropped += b.dropped
        seconds = max(1.0, until - max(since, self.first_mono or since))
        frames = sum(published.values())
        return HealthFigures(
            seconds=seconds,
            fps={stream: n / seconds for stream, n in published.items()},
            p99_ms=float(np.percentile(times, 99)) if times else None,
            infer_errors=errors,
            nan_outputs=nan,
            dropped_share=dropped / (frames + dropped) if frames + dropped else 0.0,
            classes=dict(classes),
            offered_fps={stream: n / seconds for stream, n in offered.items()},
        )


def judge(
    baseline: HealthFigures,
    current: HealthFigures,
    bars: ProbationSpec,
    *,
    final: bool,
    latency_ratio: float | None,
) -> FailedFigure | None:
    """The first figure of ``current`` that crosses its bar against ``baseline``; None while healthy.

    NaN outputs and inference errors fail at once (they count, so any time is long enough); the
    ratios (fps, latency, drops, class mix) are judged at the end (``final``), over the whole probation,
    so a slow first second after a swap (a cold cache) is not a failure.

    The fps of a stream is judged against the baseline's, or against the frames the capture handed
    the new model where those were fewer: what the model could have published.

    The latency is ``latency_ratio``: the new model's inference time over the old model's, both timed
    on the same live frames at the same moments (:func:`agent.runtime.slots.latency.judged_ratio`),
    judged against ``max_p99_ratio`` under the figure name ``p99_ratio``. The live p99s before and
    after the swap are not compared: between them the machine's load changes as much as the model.
    None (no pair could be timed: no live frame) leaves the latency unjudged.
    """
    if current.nan_outputs > bars.max_nan_outputs:
        return FailedFigure(figure="nan_outputs", value=current.nan_outputs, bar=bars.max_nan_outputs)
    if current.infer_errors > bars.max_infer_errors:
        return FailedFigure(figure="infer_errors", value=current.infer_errors, bar=bars.max_infer_errors)
    if not final:
        return None
    for stream, before in sorted(baseline.fps.items()):
        # A model cannot publish frames the capture never handed it: a camera that slowed down, or
        # a capture starved by other work, lowers the reference, not the model's score.
        reference = min(before, current.offered_fps.get(stream, before))
        if reference <= 0:
            continue
        ratio = current.fps.get(stream, 0.0) / reference
        if ratio < bars.min_fps_ratio:
            return FailedFigure(figure=f"fps_ratio.{stream}", value=round(ratio, 4), bar=bars.min_fps_ratio)
    if latency_ratio is not None and latency_ratio > bars.max_p99_ratio:
        return FailedFigure(figure="p99_ratio", value=round(latency_ratio, 4), bar=bars.max_p99_ratio)
    increase = current.dropped_share - baseline.dropped_share
    if increase > bars.max_drop_increase:
        return FailedFigure(figure="dropped_increase", value=round(increase, 4), bar=bars.max_drop_increase)
    if bars.max_class_shift is not None:
        shift = total_variation(baseline.classes, current.classes)
        if shift is not None and shift > bars.max_class_shift:
            return FailedFigure(figure="class_shift", value=round(shift, 4), bar=bars.max_class_shift)
    return None
