"""Engine benchmark, as JSON: cold build vs cache-hit time-to-active, and INT8 vs FP32 on the CPU.

1. Time-to-active = build (or cache lookup) + load + first inference, for the shapes classifier
   (``agent/assets/shapes_classifier.onnx``; an untrained stand-in of the same size when absent)
   and a MobileNet-sized model. Cold: an empty engine cache. Cache hit: a fresh
   :class:`EngineBuilder` on the same state dir (a second deploy, or an agent restart).
   Target: cache hit <= 0.2 x cold.
2. INT8 (ONNX Runtime Entropy calibration, Q/DQ) vs FP32 on the CPU with the shapes model:
   throughput at batch 1 and 32 and top-1 accuracy on held-out generated images, plus the share
   of images where INT8 and FP32 agree.

    .venv/bin/python bench/engines.py [--repeats 3] [--heldout 1000] [--out result.json]

No TensorRT here: every build is ONNX Runtime on the CPU (the plan says so in each case's
``changes``). Medians over ``--repeats`` runs; the machine is shared, so expect noise.
"""

from __future__ import annotations

import argparse
import json
import platform as host
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from agent.backends.base import LoadOptions, get_backend
from agent.camera.preprocess import preprocess
from agent.demo.modelzoo import write_classifier, write_mobilenet_like
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.settings import EngineConfig
from agent.logs.setup import configure_logging
from agent.machine.platform import detect_platform
from agent.specs.build import BuildSpec, CalibrationSource
from agent.specs.preprocess import PreprocessSpec

REPO = Path(__file__).resolve().parents[1]
SHAPES_MODEL = REPO / "agent" / "assets" / "shapes_classifier.onnx"
SHAPES_SIZE = 64
CALIBRATION_SEED = 101
HELDOUT_SEED = 202
CALIBRATION_FRAMES = 256


def shapes_model(workdir: Path) -> tuple[Path, bool]:
    """The trained shapes classifier, or an untrained classifier of the same input/output shape."""
    if SHAPES_MODEL.is_file():
        return SHAPES_MODEL, True
    from agent.datasets.shapes import CLASSES

    return write_classifier(
        workdir / "shapes_standin.onnx", input_size=SHAPES_SIZE, num_classes=len(CLASSES)
    ), False


def time_to_active(builder: EngineBuilder, model: Path, spec: BuildSpec | None) -> dict[str, Any]:
    """Build (or hit), load and run once; seconds for each step."""
    t0 = time.perf_counter()
    artifact = builder.build(model, spec)
    t1 = time.perf_counter()
    runner = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
    t2 = time.perf_counter()
    spec_in = runner.inputs[0]
    shape = [1 if not isinstance(d, int) or d <= 0 else d for d in spec_in.shape]
    runner.infer({spec_in.name: np.zeros(shape, dtype=spec_in.dtype)})
    t3 = time.perf_counter()
    runner.close()
    return {
        "cache_hit": artifact.cache_hit,
        "build_s": t1 - t0,
        "load_s": t2 - t1,
        "first_inference_s": t3 - t2,
        "time_to_active_s": t3 - t0,
    }


def _median(runs: list[dict[str, Any]], field: str) -> float:
    return statistics.median(float(r[field]) for r in runs)


def bench_cache(name: str, model: Path, repeats: int, workdir: Path) -> dict[str, Any]:
    """Cold builds in empty caches vs cache hits by fresh builders on a warm cache."""
    platform = detect_platform()
    config = EngineConfig()
    spec = BuildSpec()  # the default deploy request: fp16, device auto
    cold: list[dict[str, Any]] = []
    state = workdir / f"{name}-warm"
    for i in range(repeats):
        state_i = state if i == 0 else workdir / f"{name}-cold-{i}"
        cold.append(time_to_active(EngineBuilder(state_i, config, platform), model, spec))
    hits = [
        time_to_active(EngineBuilder(state, config, platform), model, spec) for _ in range(max(repeats, 5))
    ]
    if any(r["cache_hit"] for r in cold) or not all(r["cache_hit"] for r in hits):
        raise RuntimeError("a cold build hit the cache or a warm build missed it: the cache key is unstable")
    cold_s = _median(cold, "time_to_active_s")
    hit_s = _median(hits, "time_to_active_s")
    plan = EngineBuilder(state, config, platform).plan(model, spec)
    return {
        "model": name,
        "model_bytes": model.stat().st_size,
        "plan": {"backend": plan.backend, "device": plan.device, "precision": plan.precision},
        "changes": [f"{c.field}: {c.requested} -> {c.effective} ({c.reason})" for c in plan.changes],
        "cold": {k: _median(cold, k) for k in ("build_s", "load_s", "first_inference_s", "time_to_active_s")},
        "cache_hit": {
            k: _median(hits, k) for k in ("build_s", "load_s", "first_inference_s", "time_to_active_s")
        },
        "ratio_hit_over_cold": hit_s / cold_s,
        "target_ratio": 0.2,
        "meets_target": hit_s <= 0.2 * cold_s,
        "runs": {"cold": len(cold), "cache_hit": len(hits)},
    }


def prepare(images: npt.NDArray[np.uint8], spec: PreprocessSpec) -> npt.NDArray[np.float32]:
    return np.stack([preprocess(image, spec)[0] for image in images]).astype(np.float32)


def throughput(
    infer: Callable[[npt.NDArray[np.float32]], Any], data: npt.NDArray[np.float32], batch: int
) -> float:
    """Images per second over ``data`` in batches of ``batch`` (after one warm-up batch)."""
    infer(data[:batch])
    usable = len(data) - len(data) % batch
    started = time.perf_counter()
    for start in range(0, usable, batch):
        infer(data[start : start + batch])
    return usable / (time.perf_counter() - started)


def bench_int8(heldout: int, workdir: Path) -> dict[str, Any]:
    """INT8 vs FP32 on the CPU with the shapes model: throughput and accuracy on generated images."""
    from agent.datasets.shapes import generate

    model, trained = shapes_model(workdir)
    spec = PreprocessSpec(width=SHAPES_SIZE, height=SHAPES_SIZE)
    calib_images, _ = generate(CALIBRATION_FRAMES, seed=CALIBRATION_SEED, size=SHAPES_SIZE)
    test_images, labels = generate(heldout, seed=HELDOUT_SEED, size=SHAPES_SIZE)
    calib = prepare(calib_images, spec)
    data = prepare(test_images, spec)
    builder = EngineBuilder(workdir / "int8-state", EngineConfig(), detect_platform())
    fp32 = builder.build(model, BuildSpec(precision="fp32", device="cpu"))
    int8 = builder.build(
        model,
        BuildSpec(
            precision="int8",
            device="cpu",
            calibration=CalibrationSource(kind="stream", stream="bench", frames=CALIBRATION_FRAMES),
        ),
        calibration=(calib[i : i + 32] for i in range(0, len(calib), 32)),
    )
    results: dict[str, Any] = {}
    predictions: dict[str, npt.NDArray[np.int64]] = {}
    for name, artifact in (("fp32", fp32), ("int8", int8)):
        results[name] = _measure(artifact, data, labels)
        predictions[name] = results[name].pop("_predictions")
    agreement = float(np.mean(predictions["fp32"] == predictions["int8"]))
    return {
        "model": "shapes_classifier"
        if trained
        else "untrained stand-in (agent/assets/shapes_classifier.onnx absent)",
        "trained": trained,
        "heldout_images": heldout,
        "calibration_frames": CALIBRATION_FRAMES,
        "intra_op_threads": 1,
        "fp32": results["fp32"],
        "int8": results["int8"],
        "int8_speedup_batch1": results["int8"]["images_per_s_batch1"]
        / results["fp32"]["images_per_s_batch1"],
        "int8_speedup_batch32": results["int8"]["images_per_s_batch32"]
        / results["fp32"]["images_per_s_batch32"],
        "top1_delta_points": 100 * (results["int8"]["top1"] - results["fp32"]["top1"]),
        "int8_fp32_agreement": agreement,
    }


def _measure(
    artifact: EngineArtifact, data: npt.NDArray[np.float32], labels: npt.NDArray[np.int64]
) -> dict[str, Any]:
    # One intra-op thread: comparable on a shared machine, and what one camera stream gets.
    options = LoadOptions(providers=artifact.providers, intra_op_threads=1, extra=artifact.load_extra)
    runner = get_backend(artifact.backend).load(artifact.engine_path, options)
    name = runner.inputs[0].name
    try:

        def infer(batch: npt.NDArray[np.float32]) -> Any:
            return runner.infer({name: batch})

        scores = np.concatenate([infer(data[i : i + 100])["scores"] for i in range(0, len(data), 100)])
        predictions = scores.argmax(axis=1)
        return {
            "engine_bytes": artifact.engine_path.stat().st_size,
            "images_per_s_batch1": throughput(infer, data[:300], 1),
            "images_per_s_batch32": throughput(infer, data, 32),
            "top1": float(np.mean(predictions == labels)),
            "_predictions": predictions,
        }
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="cold builds per model (median)")
    parser.add_argument("--heldout", type=int, default=1000, help="held-out images for INT8 vs FP32")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    # stdout carries the JSON report only; the agent's logs go to stderr, warnings and up.
    configure_logging("console", "warning", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        workdir = Path(tmp)
        shapes, _trained = shapes_model(workdir)
        mobilenet = write_mobilenet_like(workdir / "mobilenet_like.onnx")
        result = {
            "machine": {
                "python": sys.version.split()[0],
                "cpu": host.machine(),
                "onnxruntime": ort.__version__,
            },
            "time_to_active": [
                bench_cache("shapes_classifier", shapes, args.repeats, workdir),
                bench_cache("mobilenet_like_224", mobilenet, args.repeats, workdir),
            ],
            "int8_vs_fp32_cpu": bench_int8(args.heldout, workdir),
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
