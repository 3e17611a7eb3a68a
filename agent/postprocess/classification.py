"""Top-k classes from a ``[classes]`` score vector (one item, batch axis removed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.backends.base import TensorSpec
from agent.errors import EngineError
from agent.postprocess.labels import label_of
from agent.postprocess.spec import ClassificationSpec
from agent.postprocess.tensors import describe_shape, pick_output, pick_output_spec
from agent.protocol.results import ClassScore, Prediction


def validate_classification(spec: ClassificationSpec, outputs: Sequence[TensorSpec]) -> None:
    """Refuse a model whose output is not one score per class (``[batch, c]``, ``[batch, c, 1, 1]``)."""
    out = pick_output_spec(outputs, spec.output_name)
    item_dims = out.shape[1:]
    # Symbolic or unknown dims may be > 1, so they count as class axes.
    class_axes = [d for d in item_dims if d != 1]
    if not item_dims or len(class_axes) > 1:
        raise EngineError(
            f"classification needs an output of shape [batch, classes]; {out.name!r} is "
            f"{describe_shape(out)}; use postprocess type 'detection' or 'raw' for this model"
        )


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


class ClassificationPostprocess:
    """Top-k :class:`ClassScore` list per frame."""

    def __init__(self, spec: ClassificationSpec, labels: Sequence[str]) -> None:
        self.spec = spec
        self.labels = list(labels)

    def __call__(self, outputs: Mapping[str, npt.NDArray[Any]]) -> Prediction:
        array = pick_output(outputs, self.spec.output_name)
        if sum(1 for d in array.shape if d != 1) > 1:
            raise EngineError(f"classification output has shape {list(array.shape)}; expected [classes]")
        scores = array.reshape(-1).astype(np.float64, copy=False)
        if scores.size == 0:
            return Prediction(classes=[])
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
