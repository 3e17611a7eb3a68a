"""A model's inputs and outputs as specs (name, shape, element type); the output a postprocess reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import EngineError

#: Dimension of a tensor: a fixed size, or a symbolic name / None for a dynamic axis.
Dim = int | str | None


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and element type of one model input or output."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str  # numpy dtype name: "float32", "float16", "uint8", "int64", ...

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) and d > 0 for d in self.shape)


def pick_output_spec(outputs: Sequence[TensorSpec], name: str | None) -> TensorSpec:
    """The output spec called ``name``, or the first one when ``name`` is None."""
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
