"""An ONNX file read as a device reads it (checked, no external data), and its graph's inputs and outputs."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.checker
from onnx import helper

from agent.model_contract.tensors import Dim, TensorSpec
from agent.protocol.delivery_errors import BadOnnxError, OnnxCheckerError


def _dtype_name(elem_type: int) -> str:
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return "unknown"


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return TensorSpec(name=value.name, shape=tuple(dims), dtype=_dtype_name(tensor.elem_type))


def graph_io(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs (initializers excluded: old exporters list weights as inputs) and outputs of a model."""
    weights = {init.name for init in model.graph.initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in weights]
    outputs = [_spec(v) for v in model.graph.output]
    return inputs, outputs


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)


def load_checked(path: Path, *, job_id: str | None = None) -> onnx.ModelProto:
    """The ONNX model at ``path``; BadOnnxError or OnnxCheckerError when a device would refuse it.

    The operator side runs the same check before signing (:mod:`agent.fleet.deploy.model_check`).
    """
    try:
        # External data stays unloaded: a model must not make the agent read files beside it.
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-ish or ValueError by version
        raise BadOnnxError(
            f"model file is not a readable ONNX model (truncated or corrupt): {exc}", job_id=job_id
        ) from exc
    if not model.graph.node and not model.graph.output:
        raise BadOnnxError("model file parsed to an empty ONNX model (truncated or not ONNX)", job_id=job_id)
    if _uses_external_data(model):
        raise BadOnnxError(
            "model uses external data files, which delivery does not support: embed the weights",
            job_id=job_id,
        )
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise OnnxCheckerError(f"onnx.checker refuses the model: {first}", job_id=job_id) from exc
    return model
