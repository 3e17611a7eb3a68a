"""GPU preprocessing vs the CPU path for a 1080p frame into a 640x640 letterboxed input, as JSON.

Run on a CUDA machine with CuPy (the lent GPU machine, or a Jetson with the gpu-preprocess extra):

    PYTHONPATH=. python3 bench/preprocess_gpu.py [--runs 200]

Prints one JSON object: the CPU path's ms per frame (agent/camera/preprocess.py), the GPU path's
host-side ms per frame (upload + kernel + synchronise, as the inference worker sees it) and the
GPU's own ms per frame (CUDA events around the upload and the kernel on one stream), all in one run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from agent.camera.gpu_preprocess import GpuPreprocessor, item_shape
from agent.camera.preprocess import preprocess
from agent.specs.preprocess import PreprocessSpec


def measure(runs: int = 200) -> dict[str, Any]:
    """The three figures, each a mean over ``runs`` frames after one warm-up."""
    import cupy

    spec = PreprocessSpec.model_validate({"width": 640, "height": 640, "resize": "letterbox"})
    frame = np.random.default_rng(7).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    gpu = GpuPreprocessor(spec)
    gpu.batch([frame])  # compiles the kernel, uploads the taps
    preprocess(frame, spec)

    t0 = time.perf_counter()
    for _ in range(runs):
        preprocess(frame, spec)
    cpu_ms = (time.perf_counter() - t0) * 1000.0 / runs

    t0 = time.perf_counter()
    for _ in range(runs):
        gpu.batch([frame])
    host_ms = (time.perf_counter() - t0) * 1000.0 / runs

    out = cupy.empty(item_shape(spec), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(runs):
            gpu._one(frame, out)  # upload + kernel, no per-frame synchronise
        end.record(stream)
        end.synchronize()
    device_ms = cupy.cuda.get_elapsed_time(start, end) / runs

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "frame": "1920x1080 bgr uint8",
        "input": "640x640 letterbox rgb float32 nchw",
        "runs": runs,
        "cpu_path_ms": round(cpu_ms, 3),
        "gpu_path_host_ms": round(host_ms, 3),
        "gpu_device_ms": round(device_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="frames per figure")
    args = parser.parse_args()
    print(json.dumps(measure(args.runs)))


if __name__ == "__main__":
    main()
