"""The operator's check of a model file before anything is signed or published.

``fleet deploy``, ``fleet rollout start`` and the controller's ``start`` run it. A device refuses a
file that is not a loadable ONNX model (``bad_onnx``, ``onnx_checker``, ``incompatible``), but only
after pulling it from a retained desired state; in a rollout that burns the canary wave. Here the
same checks the device runs (:func:`agent.model_contract.graph.load_checked`), plus what a device's ONNX
Runtime can load, fail at once with one error naming the file and what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.defs

from agent.errors import AgentError, EngineError, RejectedError
from agent.model_contract.graph import graph_io, load_checked
from agent.model_contract.input_fit import check_input_fits, select_input
from agent.model_contract.outputs import validate_outputs
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

#: The oldest ``ai.onnx`` opset ONNX Runtime loads (its compatibility notes: "opset version 7 and higher").
MIN_OPSET = 7


class ModelFileError(AgentError):
    """A model file a device would refuse; the message names the file and what is wrong."""

    code = "bad_model"


def check_model_file(
    path: Path,
    *,
    name: str | None = None,
    preprocess: PreprocessSpec | None = None,
    postprocess: PostprocessSpec | None = None,
) -> None:
    """Raise ModelFileError unless ``path`` is an ONNX model a device would load.

    ``name`` is how the error names the file (default: the path). ``preprocess``/``postprocess``,
    when the deploy carries them, are checked against the model's inputs and outputs as the device
    checks them; without them the device keeps its slot's own, which only it knows.
    """
    shown = name or str(path)
    try:
        model = load_checked(path)
    except RejectedError as exc:
        raise ModelFileError(f"{shown}: {exc}; nothing signed or published") from exc
    problem = _opset_problem(model) or _io_problem(model, preprocess, postprocess)
    if problem is not None:
        raise ModelFileError(f"{shown}: {problem}; nothing signed or published")


def _opset_problem(model: onnx.ModelProto) -> str | None:
    versions = {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}
    core = versions.get("ai.onnx")
    newest = onnx.defs.onnx_opset_version()
    if core is None:
        return "the model imports no ai.onnx opset"
    if core < MIN_OPSET:
        return f"ONNX opset {core} is older than {MIN_OPSET}, the oldest ONNX Runtime loads; re-export it"
    if core > newest:
        return (
            f"ONNX opset {core} is newer than any released opset onnx {onnx.__version__} knows "
            f"(up to {newest}); re-export it with an older opset"
        )
    return None


def _io_problem(
    model: onnx.ModelProto, preprocess: PreprocessSpec | None, postprocess: PostprocessSpec | None
) -> str | None:
    inputs, outputs = graph_io(model)
    if not inputs:
        return "the model has no inputs (only weights): a camera frame has nowhere to go"
    if not outputs:
        return "the model has no outputs"
    try:
        if preprocess is not None:
            check_input_fits(preprocess, select_input(preprocess, inputs))
        if postprocess is not None:
            validate_outputs(postprocess, outputs)
    except EngineError as exc:
        return f"does not fit the deploy's preprocess/postprocess: {exc}"
    return None
