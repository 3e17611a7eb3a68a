"""Model outputs published as (truncated) tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.protocol.results import Prediction, RawTensor
from agent.specs.postprocess import RawSpec


class RawPostprocess:
    """Every output, flattened to at most ``max_values`` numbers, with its full shape."""

    def __init__(self, spec: RawSpec) -> None:
        self.spec = spec

    def __call__(self, outputs: Mapping[str, npt.NDArray[Any]]) -> Prediction:
        limit = self.spec.max_values
        tensors = []
        for name, array in outputs.items():
            # ravel is a view for contiguous outputs; only the kept head is converted.
            head = np.ravel(array)[:limit]
            tensors.append(
                RawTensor(
                    name=name,
                    shape=[int(d) for d in array.shape],
                    values=head.astype(np.float64).tolist(),
                    truncated=array.size > limit,
                )
            )
        return Prediction(tensors=tensors)
