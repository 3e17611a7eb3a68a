"""GPU preprocessing vs the CPU path for a 1080p frame into a 640x640 letterboxed input, as JSON.

Run on a CUDA machine with CuPy (the lent GPU machine, or a Jetson with the gpu-preprocess extra):

    PYTHONPATH=. python3 bench/preprocess_gpu.py [--runs 200]

Prints one JSON object: the CPU path's ms per frame (agent/camera/preprocess.py), the GPU path's
host-side ms per frame (upload + kernel + synchronise, as the inference worker sees it) for a frame
in pageable memory and for one in a page-locked buffer (as the decoder writes it when the slot
preprocesses on the GPU), per frame in a batch of 4 page-locked frames (the uploads overlap the
kernels before them), the bounds: a synchronous upload alone from page-locked and from pageable
memory (host ms), and the GPU's own ms per frame (CUDA events around the upload and the kernel),
all in one run; ``pinned_host_over_upload`` is the GPU path's host time over the page-locked
upload's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from agent.camera.gpu_preprocess import GpuPreprocessor, item_shape
from agent.camera.preprocess import preprocess
from agent.specs.preprocess import PreprocessSpec


def _per_frame_ms(work: Callable[[], object], runs: int, frames: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        work()
    return (time.perf_counter() - t0) * 1000.0 / (runs * frames)


def measure(runs: int = 200) -> dict[str, Any]:
    """Every figure, each a mean over ``runs`` frames (or batches) after one warm-up."""
    import cupy

    spec = PreprocessSpec.model_validate({"width": 640, "height": 640, "resize": "letterbox"})
    frame = np.random.default_rng(7).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    gpu = GpuPreprocessor(spec)
    pinned = gpu.pinned.empty(frame.shape)  # what the decoder writes into on the GPU path
    pinned[...] = frame
    pinned_batch = [gpu.pinned.empty(frame.shape) for _ in range(4)]
    for buffer in pinned_batch:
        buffer[...] = frame
    gpu.batch([frame])  # compiles the kernel, uploads the taps
    gpu.batch(pinned_batch)
    preprocess(frame, spec)

    device = cupy.empty(frame.shape, dtype=np.uint8)
    copy = cupy.cuda.Stream(non_blocking=True)

    def upload(host: Any) -> None:
        device.set(host, stream=copy)
        copy.synchronize()

    upload(pinned)
    figures = {
        "cpu_path_ms": _per_frame_ms(lambda: preprocess(frame, spec), runs),
        "gpu_path_host_ms": _per_frame_ms(lambda: gpu.batch([frame]), runs),
        "gpu_path_host_pinned_ms": _per_frame_ms(lambda: gpu.batch([pinned]), runs),
        "gpu_path_host_pinned_batch4_ms_per_frame": _per_frame_ms(lambda: gpu.batch(pinned_batch), runs, 4),
        "upload_pinned_ms": _per_frame_ms(lambda: upload(pinned), runs),
        "upload_pageable_ms": _per_frame_ms(lambda: upload(frame), runs),
    }

    out = cupy.empty(item_shape(spec), dtype=np.float32)
    lane = gpu._lane()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(lane.copy)
    for _ in range(runs):
        gpu._one(frame, out, lane)  # upload + kernel, no per-frame synchronise
    end.record(lane.compute)
    end.synchronize()
    device_ms = cupy.cuda.get_elapsed_time(start, end) / runs

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "frame": "1920x1080 bgr uint8",
        "input": "640x640 letterbox rgb float32 nchw",
        "runs": runs,
        **{key: round(value, 3) for key, value in figures.items()},
        "gpu_device_ms": round(device_ms, 3),
        "pinned_host_over_upload": round(figures["gpu_path_host_pinned_ms"] / figures["upload_pinned_ms"], 2),
        "uploads_pinned": gpu.uploads_pinned,
        "uploads_pageable": gpu.uploads_pageable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="frames per figure")
    args = parser.parse_args()
    print(json.dumps(measure(args.runs)))


if __name__ == "__main__":
    main()
