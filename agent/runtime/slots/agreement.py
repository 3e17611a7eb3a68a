"""How much two models agree on the same frame, and when a shadow run has seen enough: pure functions.

A shadow run (docs/protocol.md, "Shadow and probation") feeds the same live frames to the serving
model and a candidate and compares what their postprocessing says, per postprocess kind:

* classification: top-1 agreement (1 or 0 per frame) and top-5 overlap (shared classes / 5);
* detection: F1 of the candidate's boxes against the serving model's, matched by class at IoU >= 0.5;
* raw tensors: cosine similarity of the flattened outputs (clipped at 0: opposite is no agreement).

Every function here is pure and total (an empty prediction is a value, never an error), so the edge
cases (no boxes on either side, boxes on one side only, an all-zero tensor) carry the unit tests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agent.protocol.results import ClassScore, Detection, Prediction, RawTensor
from agent.runtime.slots.latency import median_ratio

#: Boxes of the same class overlapping at least this much count as the same object.
IOU_MATCH = 0.5
#: Top-k of the overlap figure for classifiers.
TOP_K = 5

Verdict = Literal["pass", "shadow_disagrees", "too_slow", "bad_output"]


def top1_agrees(old: Sequence[ClassScore], new: Sequence[ClassScore]) -> float:
    """1.0 when both name the same best class (by index), else 0.0; two empty lists agree."""
    if not old or not new:
        return 1.0 if not old and not new else 0.0
    return 1.0 if _best(old).index == _best(new).index else 0.0


def topk_overlap(old: Sequence[ClassScore], new: Sequence[ClassScore], k: int = TOP_K) -> float:
    """Shared classes among both top-``k`` lists, over the longer list (1.0 for two empty lists)."""
    a = {c.index for c in sorted(old, key=lambda c: -c.score)[:k]}
    b = {c.index for c in sorted(new, key=lambda c: -c.score)[:k]}
    if not a and not b:
        return 1.0
    return len(a & b) / max(len(a), len(b))


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (0.0 when either has no area)."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0.0 else 0.0


def detection_f1(old: Sequence[Detection], new: Sequence[Detection], iou_min: float = IOU_MATCH) -> float:
    """F1 of ``new`` against ``old`` (the reference): boxes match one to one, same class, IoU >= ``iou_min``.

    Matching is greedy, best-scoring candidate box first, each to the unmatched reference box of its
    class it overlaps most. No boxes on either side is perfect agreement (1.0: both saw an empty
    scene); boxes on one side only is none (0.0).
    """
    if not old and not new:
        return 1.0
    if not old or not new:
        return 0.0
    unmatched = list(old)
    matched = 0
    for box in sorted(new, key=lambda d: -d.score):
        best, best_iou = None, iou_min
        for ref in unmatched:
            if ref.index != box.index:
                continue
            overlap = iou(ref.box, box.box)
            if overlap >= best_iou:
                best, best_iou = ref, overlap
        if best is not None:
            unmatched.remove(best)
            matched += 1
    precision = matched / len(new)
    recall = matched / len(old)
    return 0.0 if matched == 0 else 2 * precision * recall / (precision + recall)


def cosine_similarity(old: Sequence[float], new: Sequence[float]) -> float:
    """Cosine of the angle between two flattened outputs, clipped to [0, 1].

    Different lengths (a changed output layout) are 0.0; two all-zero vectors agree (1.0); one
    all-zero vector against a non-zero one is 0.0. Non-finite values are 0.0 (caught as bad output).
    """
    if len(old) != len(new):
        return 0.0
    dot = sum(a * b for a, b in zip(old, new, strict=True))
    na = math.sqrt(sum(a * a for a in old))
    nb = math.sqrt(sum(b * b for b in new))
    if not (math.isfinite(dot) and math.isfinite(na) and math.isfinite(nb)):
        return 0.0
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return max(0.0, min(1.0, dot / (na * nb)))


def tensors_similarity(old: Sequence[RawTensor], new: Sequence[RawTensor]) -> float:
    """Mean cosine similarity of the tensors both name (0.0 for a tensor only one side has)."""
    a = {t.name: t.values for t in old}
    b = {t.name: t.values for t in new}
    names = a.keys() | b.keys()
    if not names:
        return 1.0
    return sum(
        cosine_similarity(a.get(n, []), b.get(n, [])) if n in a and n in b else 0.0 for n in names
    ) / len(names)


def frame_agreement(old: Prediction, new: Prediction) -> float:
    """How much ``new`` agrees with ``old`` on one frame, 0..1, by the kind ``old`` is."""
    if old.classes is not None:
        return top1_agrees(old.classes, new.classes or [])
    if old.detections is not None:
        return detection_f1(old.detections, new.detections or [])
    return tensors_similarity(old.tensors or [], new.tensors or [])


@dataclass(frozen=True)
class ShadowBar:
    """What a shadow run must show (the manifest's ``shadow``, as plain numbers)."""

    frames: int
    min_agreement: float | None
    max_latency_ratio: float


@dataclass
class ShadowTally:
    """Frames compared so far and the decision they support (pure bookkeeping, no clock)."""

    bar: ShadowBar
    agreements: list[float] = field(default_factory=list)
    top5: list[float] = field(default_factory=list)
    old_ms: list[float] = field(default_factory=list)
    new_ms: list[float] = field(default_factory=list)
    bad_outputs: int = 0

    def add(self, agreement: float, old_ms: float, new_ms: float, *, top5: float | None = None) -> None:
        """One compared frame: its agreement and both models' inference times on it."""
        self.agreements.append(max(0.0, min(1.0, agreement)))
        if top5 is not None:
            self.top5.append(top5)
        self.old_ms.append(old_ms)
        self.new_ms.append(new_ms)

    @property
    def frames(self) -> int:
        return len(self.agreements)

    @property
    def agreement(self) -> float | None:
        return statistics.fmean(self.agreements) if self.agreements else None

    @property
    def latency_ratio(self) -> float | None:
        """The median over frames of new / old inference time, both timed on that frame back to back
        (:func:`~agent.runtime.slots.latency.median_ratio`: the same load under both, one stall is noise)."""
        return median_ratio(zip(self.old_ms, self.new_ms, strict=True))

    def figures(self) -> dict[str, float | int | None]:
        """What the job status shows: frames, agreement, latency_ratio (and top5 for classifiers)."""
        out: dict[str, float | int | None] = {
            "frames": self.frames,
            "agreement": _round(self.agreement),
            "latency_ratio": _round(self.latency_ratio),
        }
        if self.top5:
            out["top5_overlap"] = _round(statistics.fmean(self.top5))
        if self.bad_outputs:
            out["bad_outputs"] = self.bad_outputs
        return out

    def verdict(self, *, final: bool = False) -> Verdict | None:
        """The decision, or None while undecided.

        Early: a candidate with bad outputs (NaN/Inf) is out at once; one whose agreement could not
        reach the bar even if every remaining frame agreed is out ("clearly disagrees"); one that
        would stay above it even if every remaining frame disagreed has agreed enough, and the run
        ends once the latency ratio has its frames too. ``final`` (frames reached, or the timeout):
        judge on what was seen.
        """
        bar = self.bar
        if self.bad_outputs:
            return "bad_output"
        n, total = self.frames, max(1, bar.frames)
        if bar.min_agreement is not None and n:
            agreed = sum(self.agreements)
            best_possible = (agreed + max(0, total - n)) / max(total, n)
            if best_possible < bar.min_agreement:
                return "shadow_disagrees"
        # Certain to reach the bar whatever the rest says, and enough frames for a latency median.
        certain = bar.min_agreement is not None and sum(self.agreements) / total >= bar.min_agreement
        if certain and n < total and n * 2 >= total and not final:
            ratio = self.latency_ratio
            return "too_slow" if ratio is not None and ratio > bar.max_latency_ratio else "pass"
        if n < total and not final:
            return None
        if n == 0:
            return None
        if bar.min_agreement is not None and (self.agreement or 0.0) < bar.min_agreement:
            return "shadow_disagrees"
        ratio = self.latency_ratio
        if ratio is not None and ratio > bar.max_latency_ratio:
            return "too_slow"
        return "pass"


def total_variation(baseline: Mapping[int, int], recent: Mapping[int, int]) -> float | None:
    """Total-variation distance (0..1) between two class histograms; None when either is empty.

    Half the sum of the absolute differences of the two normalized distributions: 0 for the same
    mix of top-1 classes, 1 when they share no class at all.
    """
    a, b = sum(baseline.values()), sum(recent.values())
    if a == 0 or b == 0:
        return None
    keys = baseline.keys() | recent.keys()
    return 0.5 * sum(abs(baseline.get(k, 0) / a - recent.get(k, 0) / b) for k in keys)


def _best(classes: Sequence[ClassScore]) -> ClassScore:
    return max(classes, key=lambda c: c.score)


def _area(box: Sequence[float]) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
