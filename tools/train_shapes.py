"""Train the small shapes classifier and export it as ONNX (a developer tool, not part of the agent).

TOOL-ONLY DEPENDENCY: this script needs PyTorch, which the agent never imports and the project
venv does not contain. Install it into a separate venv::

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch numpy opencv-python-headless onnx
    PYTHONPATH=. /tmp/torchvenv/bin/python tools/train_shapes.py

It trains on images from :mod:`agent.datasets.shapes` (procedural, deterministic from a seed), folds
each BatchNorm into its convolution, and writes the network as a plain ONNX graph built with
``onnx.helper`` (Conv, Relu, MaxPool, GlobalAveragePool, Flatten, Gemm), so the export depends on
no exporter and its input/output contract is explicit:

- input ``images``: ``[batch, 3, 64, 64]`` float32, NCHW, RGB, pixels scaled by 1/255 -- exactly what
  the agent's ``PreprocessSpec(width=64, height=64)`` defaults produce from a BGR frame;
- output ``scores``: ``[batch, classes]`` float32 logits, in :data:`agent.datasets.shapes.CLASSES` order.

Opset 17, IR version 9 (ONNX Runtime 1.31 refuses the IR 14 that onnx >= 1.20 writes by default).
The script checks that ONNX Runtime, when installed, gives the same scores as PyTorch.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from agent.datasets.shapes import CLASSES, generate

try:
    import torch  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - depends on the venv the tool runs in
    torch = None

OPSET = 17
IR_VERSION = 9
SIZE = 64
#: Output channels of the four 3x3 convolutions; each of the first three is followed by a 2x2 max pool.
CHANNELS = (16, 32, 64, 64)
#: Seeds of the generated sets. Tests use other seeds for held-out and calibration images.
TRAIN_SEED = 1
VAL_SEED = 2


def to_input(images: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """BGR ``N x H x W x 3`` uint8 -> RGB NCHW float32 / 255 (the agent's default preprocessing)."""
    rgb = np.ascontiguousarray(images[..., ::-1].transpose(0, 3, 1, 2), dtype=np.float32)
    rgb /= np.float32(255.0)
    return rgb


def build_network() -> Any:
    """Conv-BN-ReLU x4 (max pool after the first three), global average pool, linear classifier."""
    nn = torch.nn
    layers: list[Any] = []
    in_ch = 3
    for i, out_ch in enumerate(CHANNELS):
        layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU()]
        if i < len(CHANNELS) - 1:
            layers.append(nn.MaxPool2d(2))
        in_ch = out_ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, len(CLASSES))]
    return nn.Sequential(*layers)


def train(args: argparse.Namespace) -> Any:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    train_x, train_y = generate(args.train_size, seed=TRAIN_SEED, size=SIZE)
    val_x, val_y = generate(args.val_size, seed=VAL_SEED, size=SIZE)
    print(
        f"generated {len(train_x)} training + {len(val_x)} validation images "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    xs, ys = torch.from_numpy(to_input(train_x)), torch.from_numpy(train_y)
    vx, vy = torch.from_numpy(to_input(val_x)), torch.from_numpy(val_y)

    model = build_network()
    steps_per_epoch = math.ceil(len(xs) / args.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.2
    )
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        t_epoch = time.perf_counter()
        model.train()
        order = torch.randperm(len(xs), generator=generator)
        total = 0.0
        for step in range(steps_per_epoch):
            idx = order[step * args.batch : (step + 1) * args.batch]
            batch = xs[idx]
            # Random horizontal flips: every class is mirror-symmetric up to rotation.
            flip = torch.rand(len(idx), generator=generator) < 0.5
            batch[flip] = batch[flip].flip(-1)
            optimizer.zero_grad()
            loss = loss_fn(model(batch), ys[idx])
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach()) * len(idx)
        acc = accuracy(model, vx, vy)
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {total / len(xs):.4f}, "
            f"validation top-1 {acc:.2%}, {time.perf_counter() - t_epoch:.1f} s",
            flush=True,
        )
    print(f"trained in {time.perf_counter() - t0:.1f} s", flush=True)
    return model.eval()


def accuracy(model: Any, x: Any, y: Any) -> float:
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(x[i : i + 512]).argmax(1) for i in range(0, len(x), 512)])
    return float((predictions == y).float().mean())


def _folded(conv: Any, bn: Any) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Conv weight and bias with the eval-mode BatchNorm after it folded in."""
    scale = bn.weight.detach().numpy() / np.sqrt(bn.running_var.numpy() + bn.eps)
    weight = conv.weight.detach().numpy() * scale[:, None, None, None]
    bias = bn.bias.detach().numpy() - bn.running_mean.numpy() * scale
    return weight.astype(np.float32), bias.astype(np.float32)


def to_onnx(model: Any) -> onnx.ModelProto:
    """The trained network as an ONNX graph (BatchNorm folded), opset 17, IR 9, dynamic batch."""
    modules = list(model)
    nodes: list[onnx.NodeProto] = []
    weights: list[onnx.TensorProto] = []
    current = "images"
    conv_index = 0
    i = 0
    while i < len(modules):
        module = modules[i]
        if isinstance(module, torch.nn.Conv2d):
            conv_index += 1
            name = f"conv{conv_index}"
            weight, bias = _folded(module, modules[i + 1])
            weights += [
                numpy_helper.from_array(weight, f"{name}.weight"),
                numpy_helper.from_array(bias, f"{name}.bias"),
            ]
            nodes.append(
                helper.make_node(
                    "Conv",
                    [current, f"{name}.weight", f"{name}.bias"],
                    [f"{name}/conv"],
                    name=name,
                    kernel_shape=[3, 3],
                    pads=[1, 1, 1, 1],
                )
            )
            nodes.append(helper.make_node("Relu", [f"{name}/conv"], [f"{name}/relu"], name=f"{name}/relu"))
            current = f"{name}/relu"
            i += 3  # Conv2d, BatchNorm2d, ReLU
        elif isinstance(module, torch.nn.MaxPool2d):
            out = f"pool{conv_index}"
            nodes.append(
                helper.make_node("MaxPool", [current], [out], name=out, kernel_shape=[2, 2], strides=[2, 2])
            )
            current = out
            i += 1
        elif isinstance(module, torch.nn.AdaptiveAvgPool2d):
            nodes.append(helper.make_node("GlobalAveragePool", [current], ["gap"], name="gap"))
            nodes.append(helper.make_node("Flatten", ["gap"], ["features"], name="flatten", axis=1))
            current = "features"
            i += 2  # AdaptiveAvgPool2d, Flatten
        elif isinstance(module, torch.nn.Linear):
            weights += [
                numpy_helper.from_array(module.weight.detach().numpy().astype(np.float32), "fc.weight"),
                numpy_helper.from_array(module.bias.detach().numpy().astype(np.float32), "fc.bias"),
            ]
            nodes.append(
                helper.make_node("Gemm", [current, "fc.weight", "fc.bias"], ["scores"], name="fc", transB=1)
            )
            current = "scores"
            i += 1
        else:
            raise TypeError(f"no ONNX export for layer {module!r}")
    graph = helper.make_graph(
        nodes,
        "shapes_classifier",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", len(CLASSES)])],
        initializer=weights,
    )
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="edge-agent tools/train_shapes.py",
        doc_string=f"Shapes classifier ({', '.join(CLASSES)}); input RGB NCHW float32 / 255, 64x64.",
    )
    proto.ir_version = IR_VERSION
    helper.set_model_props(proto, {"classes": ",".join(CLASSES)})
    onnx.checker.check_model(proto, full_check=True)
    return proto


def check_against_onnxruntime(model: Any, path: Path) -> None:
    """Compare ONNX Runtime's scores for the exported file with PyTorch's, when ORT is installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed here: skipped the ONNX Runtime comparison", flush=True)
        return
    x, _ = generate(64, seed=99, size=SIZE)
    inputs = to_input(x)
    with torch.no_grad():
        expected = model(torch.from_numpy(inputs)).numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(["scores"], {"images": inputs})[0]
    diff = float(np.abs(got - expected).max())
    print(f"ONNX Runtime vs PyTorch: max |diff| {diff:.2e}", flush=True)
    if diff > 1e-3:
        raise SystemExit(f"exported model disagrees with PyTorch (max diff {diff})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out-dir", type=Path, default=Path("agent/assets"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=12000)
    parser.add_argument("--val-size", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if torch is None:
        print(
            "PyTorch is not installed in this interpreter; see the top of this script",
            file=sys.stderr,
            flush=True,
        )
        return 2
    model = train(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = args.out_dir / "shapes_classifier.onnx"
    onnx.save(to_onnx(model), str(onnx_path))
    (args.out_dir / "shapes_labels.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    print(
        f"wrote {onnx_path} ({onnx_path.stat().st_size} bytes) and {args.out_dir / 'shapes_labels.txt'}",
        flush=True,
    )
    check_against_onnxruntime(model, onnx_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
