"""Choosing the model output a postprocess reads, per frame (at load time: :mod:`agent.model_contract`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy.typing as npt

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
