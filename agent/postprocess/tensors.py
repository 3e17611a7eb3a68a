"""Choosing the model output a postprocess reads, at load time (specs) and per frame (arrays)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt

from agent.backends.base import TensorSpec
from agent.errors import EngineError


def pick_output(outputs: Mapping[str, npt.NDArray[Any]], name: str | None) -> npt.NDArray[Any]:
    """The output called ``name``, or the first one when ``name`` is None."""
    if name is None:
        for array in outputs.values():
            return array
        raise EngineError("the model produced no outputs")
    try:
        return outputs[name]
    except KeyError:
        known = ", ".join(outputs) or "none"
        raise EngineError(
            f"postprocess reads output {name!r}, the model produced: {known}; fix postprocess.output_name"
        ) from None


def pick_output_spec(outputs: Sequence[TensorSpec], name: str | None) -> TensorSpec:
    """Load-time counterpart of :func:`pick_output`."""
    if not outputs:
        raise EngineError("the model has no outputs")
    if name is None:
        return outputs[0]
    for spec in outputs:
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in outputs)
    raise EngineError(
        f"postprocess reads output {name!r}, the model has: {known}; fix postprocess.output_name"
    )


def describe_shape(spec: TensorSpec) -> str:
    """``[batch, 84, 8400]`` style text of a tensor shape for error messages."""
    return "[" + ", ".join("?" if d is None else str(d) for d in spec.shape) + "]"
