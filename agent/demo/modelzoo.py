"""Small, real ONNX models generated from a seed, for tests, the demo and the benchmark.

Every model takes ``images`` (``[batch, 3, S, S]`` float32, NCHW) with a dynamic batch axis named
``batch``, uses opset 17 and is saved with IR version 9. Weights are drawn from a seeded generator,
so a path, a seed and the arguments always give the same bytes; different seeds give different
outputs (the demo hot-swaps v1 -> v2 by seed). Nothing here is trained: outputs are plausible, not
meaningful.

Ships with the package because ``edge-agent demo`` builds its models with it (the benchmarks and
tests use it too); models that misbehave on purpose, which only tests need, are in ``tests/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Opset every generated model imports.
OPSET = 17
#: onnx >= 1.17 writes a newer IR version by default, which older ONNX Runtime releases (as shipped
#: on JetPack, and 1.31 here) refuse to load; 9 is the IR version of opset 17's release.
IR_VERSION = 9
#: Name of the dynamic batch axis of every input and output.
BATCH = "batch"


class _GraphBuilder:
    """Accumulates nodes and seeded initializers; names are generated, only inputs/outputs are fixed."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, prefix: str, value: npt.NDArray[np.generic]) -> str:
        name = self.name(prefix)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: Any) -> str:
        out = output or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        *,
        kernel: int = 3,
        stride: int = 1,
        groups: int = 1,
        act: Literal["relu", "relu6", "none"] = "relu",
        bias: npt.NDArray[np.float32] | None = None,
    ) -> str:
        fan_in = (cin // groups) * kernel * kernel
        # He initialisation keeps activations in range through deep ReLU stacks without batch norm.
        weight = self.rng.normal(0.0, np.sqrt(2.0 / fan_in), (cout, cin // groups, kernel, kernel))
        b = bias if bias is not None else self.rng.normal(0.0, 0.01, cout).astype(np.float32)
        pad = kernel // 2
        y = self.op(
            "Conv",
            [x, self.const("w", weight.astype(np.float32)), self.const("b", b.astype(np.float32))],
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad, pad, pad, pad],
            group=groups,
        )
        if act == "relu":
            return self.op("Relu", [y])
        if act == "relu6":
            lo = self.const("lo", np.array(0.0, dtype=np.float32))
            hi = self.const("hi", np.array(6.0, dtype=np.float32))
            return self.op("Clip", [y, lo, hi])
        return y

    def dense(self, x: str, cin: int, cout: int, output: str) -> str:
        weight = self.rng.normal(0.0, np.sqrt(1.0 / cin), (cin, cout)).astype(np.float32)
        bias = self.rng.normal(0.0, 0.1, cout).astype(np.float32)
        return self.op("Gemm", [x, self.const("fc_w", weight), self.const("fc_b", bias)], output)

    def save(self, path: Path, graph_name: str, size: int, outputs: list[onnx.ValueInfoProto]) -> Path:
        images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [BATCH, 3, size, size])
        graph = helper.make_graph(self.nodes, graph_name, [images], outputs, self.initializers)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edge-agent-modelzoo"
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save_model(model, str(path))
        return path


def _head(g: _GraphBuilder, x: str, channels: int, num_classes: int, output: str) -> str:
    pooled = g.op("GlobalAveragePool", [x])
    flat = g.op("Flatten", [pooled], axis=1)
    return g.dense(flat, channels, num_classes, output)


def _scores_output(num_classes: int) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [BATCH, num_classes])]


def write_classifier(
    path: Path, *, input_size: int = 64, num_classes: int = 10, seed: int = 0, width: int = 8
) -> Path:
    """Three conv+ReLU stages (two max-pooled), average pool, Gemm: ``scores [batch, num_classes]``."""
    g = _GraphBuilder(seed)
    x = g.conv("images", 3, width)
    x = g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.conv(x, width, 2 * width)
    x = g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.conv(x, 2 * width, 4 * width)
    _head(g, x, 4 * width, num_classes, "scores")
    return g.save(path, "classifier", input_size, _scores_output(num_classes))


def write_tiny_classifier(
    path: Path, *, input_size: int = 32, num_classes: int = 10, seed: int = 0, width: int = 64
) -> Path:
    """Two conv+ReLU layers, pool and Gemm: about 0.3 ms on one x86 core at 32x32, width 64.

    That is what decoding a 640x480 frame costs, so a benchmark with it measures the pipeline
    (capture, preprocess, publish) rather than the model.
    """
    g = _GraphBuilder(seed)
    x = g.conv("images", 3, width)
    x = g.conv(x, width, width)
    _head(g, x, width, num_classes, "scores")
    return g.save(path, "tiny_classifier", input_size, _scores_output(num_classes))


#: MobileNet v1 body: (output channels at width 1.0, stride) of each depthwise-separable block.
_MOBILENET_BLOCKS = (
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (1024, 2),
    (1024, 1),
)


def write_mobilenet_like(
    path: Path, *, input_size: int = 224, num_classes: int = 1000, seed: int = 0, width: float = 1.0
) -> Path:
    """MobileNet v1 topology (depthwise-separable convs, ReLU6): ~0.57 GMAC and 4.2 M weights at 224/1.0.

    Generated, not trained; for benchmarks that need a realistic cost per frame.
    """
    g = _GraphBuilder(seed)

    def channels(c: int) -> int:
        return max(8, int(c * width))

    cin = channels(32)
    x = g.conv("images", 3, cin, stride=2, act="relu6")
    for cout_full, stride in _MOBILENET_BLOCKS:
        cout = channels(cout_full)
        x = g.conv(x, cin, cin, stride=stride, groups=cin, act="relu6")  # depthwise 3x3
        x = g.conv(x, cin, cout, kernel=1, act="relu6")  # pointwise 1x1
        cin = cout
    _head(g, x, cin, num_classes, "scores")
    return g.save(path, "mobilenet_like", input_size, _scores_output(num_classes))


#: Stride of the detector's output grid (four stride-2 convs).
DETECTOR_STRIDE = 16


def write_detector(
    path: Path,
    *,
    fmt: Literal["yolov5", "yolov8"] = "yolov8",
    input_size: int = 320,
    num_classes: int = 3,
    seed: int = 0,
) -> Path:
    """A small conv backbone with a YOLO-style decoded head, output ``output0``.

    yolov8: ``[batch, 4+num_classes, n]``; yolov5: ``[batch, n, 5+num_classes]``, with
    ``n = (input_size / 16) ** 2`` boxes, one per grid cell. Centres are ``(cell + sigmoid) * 16``
    (inside the input), sizes ``sigmoid * input_size / 4``, objectness and class scores sigmoids;
    the head is normalised per image so a few boxes pass a 0.25 threshold on any non-constant image.
    """
    if input_size % DETECTOR_STRIDE:
        raise ValueError(f"input_size must be a multiple of {DETECTOR_STRIDE}, got {input_size}")
    g = _GraphBuilder(seed)
    x = g.conv("images", 3, 8, stride=2)
    x = g.conv(x, 8, 16, stride=2)
    x = g.conv(x, 16, 32, stride=2)
    x = g.conv(x, 32, 32, stride=2)
    extra = 1 if fmt == "yolov5" else 0  # objectness
    channels = 4 + extra + num_classes
    x = g.conv(x, 32, channels, kernel=1, act="none")
    # Random weights give head maps whose mean and spread depend on the seed; normalising each map
    # over the image and then setting its spread and offset makes "a few percent of the cells
    # score above 0.25" hold for every seed and (non-constant) image.
    spread = np.ones(channels, dtype=np.float32)
    offset = np.zeros(channels, dtype=np.float32)
    offset[4 : 4 + extra] = 2.0  # objectness ~0.9
    offset[4 + extra :] = -3.5  # class scores ~0.03: above 0.25 only 2.4 sigma out
    x = g.op("InstanceNormalization", [x, g.const("spread", spread), g.const("offset", offset)])
    flat = g.op("Reshape", [x, g.const("shape", np.array([0, channels, -1], dtype=np.int64))])

    def part(start: int, end: int) -> str:
        ints = [g.const("s", np.array([v], dtype=np.int64)) for v in (start, end, 1)]
        return g.op("Slice", [flat, ints[0], ints[1], ints[2]])

    cells = input_size // DETECTOR_STRIDE
    ys, xs = np.meshgrid(np.arange(cells), np.arange(cells), indexing="ij")
    grid = np.stack([xs.ravel(), ys.ravel()])[None].astype(np.float32)  # [1, 2, n]: cx, cy cell
    centre = g.op("Add", [g.op("Sigmoid", [part(0, 2)]), g.const("grid", grid)])
    centre = g.op("Mul", [centre, g.const("stride", np.array(DETECTOR_STRIDE, dtype=np.float32))])
    size = g.op("Mul", [g.op("Sigmoid", [part(2, 4)]), g.const("wh", np.array(input_size / 4, np.float32))])
    scores = g.op("Sigmoid", [part(4, channels)])
    name = "output0"
    if fmt == "yolov8":
        g.op("Concat", [centre, size, scores], name, axis=1)
        shape: list[str | int] = [BATCH, channels, cells * cells]
    else:
        rows = g.op("Concat", [centre, size, scores], axis=1)
        g.op("Transpose", [rows], name, perm=[0, 2, 1])
        shape = [BATCH, cells * cells, channels]
    out = helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
    return g.save(path, f"detector_{fmt}", input_size, [out])
