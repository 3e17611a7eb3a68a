"""What an ONNX file says about itself, read without loading its weights: static shapes, Q/DQ, image size."""

from __future__ import annotations

from pathlib import Path

import onnx

from agent.errors import BuildError


def model_facts(model: Path) -> tuple[bool, bool]:
    """``(static, has_qdq)``: every input has a fixed shape; the graph has Q/DQ nodes."""
    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception as exc:
        # Said to an operator whose device holds a bad deployment and to `edge-agent build` alike:
        # both fix it at the source.
        raise BuildError(f"{model} is not a readable ONNX model ({exc}): export it again") from exc
    initializers = {init.name for init in proto.graph.initializer}
    static = True
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            static = False
    has_qdq = any(node.op_type in ("QuantizeLinear", "DequantizeLinear") for node in proto.graph.node)
    return static, has_qdq


def model_input_size(model: Path) -> tuple[int, int] | None:
    """``(width, height)`` of an NCHW image input with fixed spatial size, else None."""
    proto = onnx.load(str(model), load_external_data=False)
    initializers = {init.name for init in proto.graph.initializer}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 4 and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims[2:]):
            return int(dims[3].dim_value), int(dims[2].dim_value)
        return None
    return None
