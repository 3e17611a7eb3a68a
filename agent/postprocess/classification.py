"""Top-k classes from a ``[classes]`` score vector (one item, batch axis removed).

A vector of up to :data:`SMALL_VECTOR` classes is handled as a Python list (:func:`top_k_small`):
numpy costs about a microsecond per call whatever the size, and the numpy path makes a dozen calls
per frame, several times the arithmetic on ten floats. Both paths give the same classes in the same
order and, where numpy's ``exp`` is the C library's (as on x86 without AVX-512), the same scores to
the bit; elsewhere a score may differ in its last bit (tests/postprocess/test_classification.py
compares the two paths).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.errors import EngineError
from agent.postprocess.labels import label_of
from agent.postprocess.tensors import pick_output
from agent.protocol.results import ClassScore, Prediction
from agent.specs.postprocess import ClassificationSpec

#: Most classes handled as a Python list: numpy's fixed cost per call outweighs its speed for a short
#: vector; past a few dozen classes numpy wins.
SMALL_VECTOR = 32


def softmax(scores: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Numerically stable softmax of a 1-D vector (the max is subtracted before ``exp``)."""
    values = np.asarray(scores, dtype=np.float64)
    shifted: npt.NDArray[np.float64] = values - values.max()
    np.exp(shifted, out=shifted)
    shifted /= shifted.sum()
    return shifted


def needs_softmax(scores: npt.NDArray[Any], mode: str) -> bool:
    """``auto``: apply softmax unless the scores already are non-negative and sum to ~1."""
    if mode != "auto":
        return mode == "always"
    # min() and sum(): two reductions, no temporary boolean array (this runs once per frame).
    return not (float(scores.min()) >= 0.0 and abs(float(scores.sum(dtype=np.float64)) - 1.0) < 1e-3)


def numpy_order_sum(values: list[float]) -> float:
    """``sum`` of up to 128 floats added in the order numpy's pairwise sum adds them (pure).

    numpy adds fewer than 8 values in a row, and up to 128 in eight interleaved partial sums joined
    pairwise; adding in that order gives numpy's result to the bit (Python's ``sum`` would differ in
    the last bit for 8 values and more, and Python 3.12's is compensated).
    """
    n = len(values)
    if n < 8:
        total = 0.0
        for value in values:
            total += value
        return total
    r0, r1, r2, r3, r4, r5, r6, r7 = values[:8]
    whole = n - n % 8
    for i in range(8, whole, 8):
        r0 += values[i]
        r1 += values[i + 1]
        r2 += values[i + 2]
        r3 += values[i + 3]
        r4 += values[i + 4]
        r5 += values[i + 5]
        r6 += values[i + 6]
        r7 += values[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for value in values[whole:]:
        total += value
    return total


def top_k_small(values: list[float], mode: str, k: int) -> list[tuple[int, float]] | None:
    """Top-``k`` ``(index, score)`` of up to 128 scores, the numpy path's arithmetic in Python (pure).

    None when a value is NaN or infinite: the numpy path decides those (its ``min``/``max`` see a
    NaN wherever it is; Python's do not).
    """
    total = numpy_order_sum(values)
    if not math.isfinite(total):
        return None
    if mode == "always" or (mode == "auto" and not (min(values) >= 0.0 and abs(total - 1.0) < 1e-3)):
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        norm = numpy_order_sum(exps)
        values = [e / norm for e in exps]
    # Python's sort is stable with reverse=True too: equal scores keep index order, like numpy's
    # stable argsort of the negated scores.
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)[:k]
    return [(i, values[i]) for i in order]


class ClassificationPostprocess:
    """Top-k :class:`ClassScore` list per frame."""

    def __init__(self, spec: ClassificationSpec, labels: Sequence[str]) -> None:
        self.spec = spec
        self.labels = list(labels)
        #: Label of each class index, filled on first use (the class count is the model's).
        self._names: list[str] = []

    def __call__(self, outputs: Mapping[str, npt.NDArray[Any]]) -> Prediction:
        array = pick_output(outputs, self.spec.output_name)
        if sum(1 for d in array.shape if d != 1) > 1:
            raise EngineError(f"classification output has shape {list(array.shape)}; expected [classes]")
        if array.size == 0:
            return Prediction(classes=[])
        if array.size <= SMALL_VECTOR and array.dtype.kind == "f":
            top_small = top_k_small(array.reshape(-1).tolist(), self.spec.softmax, self.spec.top_k)
            if top_small is not None:
                names = self._label_names(array.size)
                return Prediction(
                    classes=[ClassScore(index=i, label=names[i], score=s) for i, s in top_small]
                )
        scores = array.reshape(-1).astype(np.float64, copy=False)
        if needs_softmax(scores, self.spec.softmax):
            scores = softmax(scores)
        k = min(self.spec.top_k, scores.size)
        # Stable sort of the negated scores: equal scores keep index order, lowest index first.
        top = np.argsort(-scores, kind="stable")[:k]
        # Plain Python numbers in bulk (tolist) rather than one numpy scalar per class; validated
        # constructors, which pydantic-core runs faster than model_construct's Python path.
        labels = self.labels
        return Prediction(
            classes=[
                ClassScore(index=i, label=label_of(labels, i), score=score)
                for i, score in zip(top.tolist(), scores[top].tolist(), strict=True)
            ]
        )

    def _label_names(self, classes: int) -> list[str]:
        if len(self._names) < classes:
            self._names = [label_of(self.labels, i) for i in range(classes)]
        return self._names
