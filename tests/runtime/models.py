"""Real ONNX models that misbehave on purpose, for slot and pipeline tests.

All take ``images`` ``[batch, 3, S, S]`` float32 like :mod:`agent.demo.modelzoo` models, so a slot can
swap between them and the model zoo's classifiers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from agent.demo.modelzoo import IR_VERSION, OPSET, write_classifier


def _save(
    path: Path,
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    size: int,
    classes: int,
    batch: int | str = "batch",
    check: bool = True,
) -> Path:
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, size, size])
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, classes])
    graph = helper.make_graph(nodes, path.stem.replace("-", "_"), [images], [scores], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    if check:
        onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return path


def _mean_column(nodes: list[onnx.NodeProto]) -> str:
    """``images`` -> ``[batch, 1]`` mean pixel value (keeps every model input-dependent)."""
    nodes.append(helper.make_node("ReduceMean", ["images"], ["mean4"], axes=[1, 2, 3], keepdims=1))
    nodes.append(helper.make_node("Flatten", ["mean4"], ["mean"], axis=1))
    return "mean"


def write_nan_classifier(path: Path, *, input_size: int = 32, classes: int = 4) -> Path:
    """Scores are ``mean * 1 + log(-1)``: NaN for every input, with the right shapes."""
    nodes: list[onnx.NodeProto] = []
    mean = _mean_column(nodes)
    inits = [
        numpy_helper.from_array(np.ones((1, classes), np.float32), "ones"),
        numpy_helper.from_array(np.full((1, classes), -1.0, np.float32), "minus_one"),
    ]
    nodes.append(helper.make_node("Mul", [mean, "ones"], ["spread"]))
    nodes.append(helper.make_node("Log", ["minus_one"], ["nan"]))
    nodes.append(helper.make_node("Add", ["spread", "nan"], ["scores"]))
    return _save(path, nodes, inits, input_size, classes)


def write_slow_classifier(
    path: Path, *, input_size: int = 32, classes: int = 4, dim: int = 256, repeats: int = 6
) -> Path:
    """``repeats`` input-dependent ``[dim, dim]`` matrix products per frame (ORT cannot fold them away).

    About ``2 * repeats * dim**3`` FLOPs per frame: a few milliseconds at the defaults, so a camera
    producing frames unpaced outruns it.
    """
    rng = np.random.default_rng(0)
    nodes: list[onnx.NodeProto] = []
    mean = _mean_column(nodes)
    # An orthogonal matrix keeps the products bounded however many are chained.
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    inits = [
        numpy_helper.from_array(q.astype(np.float32), "q"),
        numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "shape3"),
        numpy_helper.from_array(np.array([0], np.int64), "start"),
        numpy_helper.from_array(np.array([classes], np.int64), "stop"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes.append(helper.make_node("Reshape", [mean, "shape3"], ["m0"]))
    nodes.append(helper.make_node("Mul", ["m0", "q"], ["x0"]))  # [batch, dim, dim]
    x = "x0"
    for i in range(repeats):
        nodes.append(helper.make_node("MatMul", [x, "q"], [f"x{i + 1}"]))
        x = f"x{i + 1}"
    nodes.append(helper.make_node("ReduceMean", [x], ["rows"], axes=[2], keepdims=0))  # [batch, dim]
    nodes.append(helper.make_node("Slice", ["rows", "start", "stop", "axis1"], ["scores"]))
    return _save(path, nodes, inits, input_size, classes)


def write_static_batch_classifier(
    path: Path, *, input_size: int = 32, classes: int = 4, seed: int = 0
) -> Path:
    """The model zoo classifier with its batch axis fixed to 1, as many exported models are."""
    write_classifier(path, input_size=input_size, num_classes=classes, seed=seed)
    model = onnx.load_model(str(path))
    for value in (*model.graph.input, *model.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_param")
        dim.dim_value = 1
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return path


def write_checker_failure(path: Path, *, size: int = 64, classes: int = 10) -> Path:
    """Parses as ONNX, but a node reads a tensor nothing produces: onnx.checker refuses it."""
    return _save(path, [helper.make_node("Relu", ["nowhere"], ["scores"])], [], size, classes, check=False)


def _rewire_scores(src: Path, dst: Path) -> tuple[onnx.ModelProto, str]:
    """``src`` loaded with its ``scores`` output renamed, so new nodes can compute ``scores`` from it."""
    model = onnx.load_model(str(src))
    # A model already rewired once (bad models compose: slow and late-NaN) has a scores_src.
    taken = {name for node in model.graph.node for name in node.output}
    renamed = "scores_src"
    while renamed in taken:
        renamed += "_"
    for node in model.graph.node:
        node.output[:] = [renamed if name == "scores" else name for name in node.output]
    return model, renamed


def _finish(model: onnx.ModelProto, dst: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save_model(model, str(dst))
    return dst


def write_swapped_classes(src: Path, dst: Path, *, classes: int = 4) -> Path:
    """``src`` with its classes moved one place (a mislabeled export: for two classes, swapped).

    Same weights, same speed, same shapes, finite outputs: only the top-1 class differs, on every frame.
    """
    model, scores = _rewire_scores(src, dst)
    perm = np.roll(np.arange(classes, dtype=np.int64), 1)
    model.graph.initializer.append(numpy_helper.from_array(perm, "class_perm"))
    model.graph.node.append(helper.make_node("Gather", [scores, "class_perm"], ["scores"], axis=1))
    return _finish(model, dst)


def write_slower(src: Path, dst: Path, *, dim: int = 192, repeats: int = 6) -> Path:
    """``src`` plus an input-dependent side branch of ``repeats`` ``[dim, dim]`` matrix products whose
    result is multiplied by zero: the same answers as ``src`` (agreement 1.0), several times slower."""
    model, scores = _rewire_scores(src, dst)
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(dim, dim)))
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(q.astype(np.float32), "slow_q"),
            numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "slow_shape3"),
            numpy_helper.from_array(np.zeros((1, 1), np.float32), "slow_zero"),
        ]
    )
    nodes = model.graph.node
    nodes.append(helper.make_node("ReduceMean", ["images"], ["slow_mean4"], axes=[1, 2, 3], keepdims=1))
    nodes.append(helper.make_node("Reshape", ["slow_mean4", "slow_shape3"], ["slow_m"]))
    nodes.append(helper.make_node("Mul", ["slow_m", "slow_q"], ["slow_x0"]))
    x = "slow_x0"
    for i in range(repeats):
        nodes.append(helper.make_node("MatMul", [x, "slow_q"], [f"slow_x{i + 1}"]))
        x = f"slow_x{i + 1}"
    nodes.append(helper.make_node("ReduceMean", [x], ["slow_sum"], axes=[1, 2], keepdims=1))
    nodes.append(helper.make_node("Flatten", ["slow_sum"], ["slow_col"], axis=1))
    nodes.append(helper.make_node("Mul", ["slow_col", "slow_zero"], ["slow_nothing"]))
    nodes.append(helper.make_node("Add", [scores, "slow_nothing"], ["scores"]))
    return _finish(model, dst)


def write_nan_when_bright(src: Path, dst: Path, *, threshold: float = 0.5) -> Path:
    """``src``, except that its scores turn NaN on frames whose mean input value exceeds ``threshold``.

    ``scores + 0 * log(threshold - mean)``: finite (the same answers) on darker frames, NaN on brighter
    ones. On a video that brightens over time, it "emits NaN after N frames": it passes validation
    and a shadow run on the early, dark frames and fails once the bright ones arrive.
    """
    model, scores = _rewire_scores(src, dst)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.full((1, 1), threshold, np.float32), "nan_threshold"),
            numpy_helper.from_array(np.zeros((1, 1), np.float32), "nan_zero"),
        ]
    )
    nodes = model.graph.node
    nodes.append(helper.make_node("ReduceMean", ["images"], ["nan_mean4"], axes=[1, 2, 3], keepdims=1))
    nodes.append(helper.make_node("Flatten", ["nan_mean4"], ["nan_mean"], axis=1))
    nodes.append(helper.make_node("Sub", ["nan_threshold", "nan_mean"], ["nan_margin"]))
    nodes.append(helper.make_node("Log", ["nan_margin"], ["nan_log"]))
    nodes.append(helper.make_node("Mul", ["nan_log", "nan_zero"], ["nan_term"]))
    nodes.append(helper.make_node("Add", [scores, "nan_term"], ["scores"]))
    return _finish(model, dst)


def write_squeezed_activation_scales(src: Path, dst: Path, *, factor: float = 0.05) -> Path:
    """A Q/DQ model (``src``) with every activation scale but the input's multiplied by ``factor``.

    A deliberately poor INT8 build, made reliably poor: with each activation's step ``factor`` times
    too small, every quantized activation saturates at ``factor`` of its calibrated range, the
    features lose their shape and the classifier settles on one class for most frames. Measured on
    the bundled shapes model (entropy calibration on 64 generated images, then ``factor`` 0.05):
    top-1 agreement with FP32 on 200 generated frames 0.21, against 1.0 for the unperturbed build.
    Weights, graph and speed are untouched: only the initializers that QuantizeLinear reads as its
    scale change (dequantization reads the same initializers, so each Q/DQ pair stays consistent).
    """
    model = onnx.load_model(str(src))
    scales = {node.input[1] for node in model.graph.node if node.op_type == "QuantizeLinear"}
    graph_input = {value.name for value in model.graph.input}
    squeezed = 0
    for init in model.graph.initializer:
        # The input's scale stays: squeezing it would only clip the pixels, a camera problem.
        if init.name in scales and init.name.removesuffix("_scale") not in graph_input:
            scale = numpy_helper.to_array(init).astype(np.float32) * np.float32(factor)
            init.CopyFrom(numpy_helper.from_array(scale, init.name))
            squeezed += 1
    if not squeezed:
        raise ValueError(f"{src} has no QuantizeLinear activation scale to perturb: is it a Q/DQ model?")
    return _finish(model, dst)


def _rewire(src: Path, output: str) -> tuple[onnx.ModelProto, str]:
    """``src`` loaded with its ``output`` renamed, so new nodes can compute ``output`` from it."""
    model = onnx.load_model(str(src))
    renamed = f"{output}_src"
    for node in model.graph.node:
        node.output[:] = [renamed if name == output else name for name in node.output]
    return model, renamed


def write_detector_classes_rolled(src: Path, dst: Path, *, classes: int = 3) -> Path:
    """A yolov8-layout detector (``output0`` ``[batch, 4 + classes, n]``) with its class rows moved one
    place: the same boxes, each with another class (a mislabeled export)."""
    model, out = _rewire(src, "output0")
    rows = np.concatenate([np.arange(4), 4 + np.roll(np.arange(classes), 1)]).astype(np.int64)
    model.graph.initializer.append(numpy_helper.from_array(rows, "rolled_rows"))
    model.graph.node.append(helper.make_node("Gather", [out, "rolled_rows"], ["output0"], axis=1))
    return _finish(model, dst)


def write_detector_boxes_moved(src: Path, dst: Path, *, shift: float, classes: int = 3) -> Path:
    """A yolov8-layout detector whose box centres are moved ``shift`` pixels right: the same classes
    and scores, boxes in the wrong place (no overlap with the originals once ``shift`` exceeds the
    widest box)."""
    model, out = _rewire(src, "output0")
    offset = np.zeros((1, 4 + classes, 1), np.float32)
    offset[0, 0, 0] = shift
    model.graph.initializer.append(numpy_helper.from_array(offset, "moved_offset"))
    model.graph.node.append(helper.make_node("Add", [out, "moved_offset"], ["output0"]))
    return _finish(model, dst)


def write_copy(src: Path, dst: Path) -> Path:
    """``src``'s graph and weights under other bytes (a new version that is the same model)."""
    model = onnx.load_model(str(src))
    model.doc_string = f"copy of {src.name}"
    return _finish(model, dst)


def write_slower_when_bright(
    src: Path, dst: Path, *, threshold: float = 0.5, dim: int = 192, repeats: int = 10
) -> Path:
    """``src``, plus ``repeats`` ``[dim, dim]`` matrix products on batches whose mean input value
    exceeds ``threshold`` (an ``If``: ONNX Runtime runs only the branch taken), multiplied by zero.

    The same answers as ``src`` on every frame, and its speed on dark frames; on a camera whose
    scene turns bright, a model that "gets slow later", with nothing in the agent told to slow it.
    """
    model, scores = _rewire_scores(src, dst)
    q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(dim, dim)))
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(q.astype(np.float32), "late_q"),
            numpy_helper.from_array(np.array(threshold, np.float32), "late_threshold"),
            numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "late_shape3"),
            numpy_helper.from_array(np.array([1, 1], np.int64), "late_shape2"),
            numpy_helper.from_array(np.zeros((1, 1), np.float32), "late_zero"),
        ]
    )
    heavy: list[onnx.NodeProto] = [
        helper.make_node("ReduceMean", ["images"], ["late_mean4"], axes=[1, 2, 3], keepdims=1),
        helper.make_node("Reshape", ["late_mean4", "late_shape3"], ["late_m"]),
        helper.make_node("Mul", ["late_m", "late_q"], ["late_x0"]),
    ]
    x = "late_x0"
    for i in range(repeats):
        heavy.append(helper.make_node("MatMul", [x, "late_q"], [f"late_x{i + 1}"]))
        x = f"late_x{i + 1}"
    heavy.append(helper.make_node("ReduceMean", [x], ["late_heavy"], axes=[0, 1, 2], keepdims=1))
    out = helper.make_tensor_value_info("late_heavy", TensorProto.FLOAT, [1, 1, 1])
    light_out = helper.make_tensor_value_info("late_light", TensorProto.FLOAT, [1, 1, 1])
    light = helper.make_node(
        "Constant",
        [],
        ["late_light"],
        value=numpy_helper.from_array(np.zeros((1, 1, 1), np.float32), "late_light_value"),
    )
    nodes = model.graph.node
    nodes.append(helper.make_node("ReduceMean", ["images"], ["late_level"], keepdims=0))
    nodes.append(helper.make_node("Greater", ["late_level", "late_threshold"], ["late_bright"]))
    nodes.append(
        helper.make_node(
            "If",
            ["late_bright"],
            ["late_branch"],
            then_branch=helper.make_graph(heavy, "late_then", [], [out]),
            else_branch=helper.make_graph([light], "late_else", [], [light_out]),
        )
    )
    nodes.append(helper.make_node("Reshape", ["late_branch", "late_shape2"], ["late_col"]))
    nodes.append(helper.make_node("Mul", ["late_col", "late_zero"], ["late_nothing"]))
    nodes.append(helper.make_node("Add", [scores, "late_nothing"], ["scores"]))
    return _finish(model, dst)
