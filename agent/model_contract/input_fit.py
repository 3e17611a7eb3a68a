"""Does a model's input fit a slot's preprocessing? Pure checks on tensor specs, no framework.

Checked on the ONNX graph by the operator before signing and by delivery before anything is
built, and on the loaded runner by :func:`agent.runtime.slots.slot.validate_candidate`, so all refuse
the same models with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.errors import EngineError
from agent.model_contract.tensors import TensorSpec
from agent.specs.preprocess import PreprocessSpec


def select_input(preprocess: PreprocessSpec, inputs: Sequence[TensorSpec]) -> TensorSpec:
    """The input the slot feeds: ``preprocess.input_name``, or the only input; EngineError otherwise."""
    names = [spec.name for spec in inputs]
    wanted = preprocess.input_name
    if wanted is None:
        if len(inputs) != 1:
            raise EngineError(f"model has inputs {names}; set preprocess.input_name to choose one")
        return inputs[0]
    for spec in inputs:
        if spec.name == wanted:
            return spec
    raise EngineError(f"preprocess.input_name {wanted!r} is not an input of the model (inputs: {names})")


def preprocess_shape(preprocess: PreprocessSpec) -> tuple[int, int, int]:
    """Shape of one preprocessed frame, without the batch axis."""
    if preprocess.layout == "nchw":
        return (3, preprocess.height, preprocess.width)
    return (preprocess.height, preprocess.width, 3)


def check_input_fits(preprocess: PreprocessSpec, spec: TensorSpec) -> None:
    """Raise EngineError when a fixed axis of ``spec`` differs from what preprocessing produces.

    Axis 0 is the batch; dynamic axes (names, None, <= 0) accept anything.
    """
    expected = preprocess_shape(preprocess)
    if len(spec.shape) != len(expected) + 1:
        raise EngineError(
            f"model input {spec.name!r} has shape {list(spec.shape)} ({len(spec.shape)} axes) but preprocess "
            f"produces [batch, {', '.join(map(str, expected))}]"
        )
    for axis, (want, got) in enumerate(zip(spec.shape[1:], expected, strict=False), start=1):
        if isinstance(want, int) and want > 0 and want != got:
            raise EngineError(
                f"model input {spec.name!r} axis {axis} is {want} but preprocess produces {got} "
                f"(preprocess {preprocess.width}x{preprocess.height} {preprocess.layout})"
            )
