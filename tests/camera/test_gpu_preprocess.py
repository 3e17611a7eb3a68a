"""GPU preprocessing: the decisions everywhere; on a CUDA machine (``gpu``), equality with the CPU path.

No GPU here: the unmarked tests check what the kernel is built from and when a slot uses it. The
``gpu`` tests run on the lent GPU machine with CuPy installed (docs/gpu.md): they compare the
kernel's tensor with :func:`agent.camera.preprocess.preprocess` over sizes, letterbox and stretch,
RGB/BGR, NCHW/NHWC and float32/float16/uint8, and print the 1080p -> 640x640 timings as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.camera.gpu_preprocess import (
    BLOCK,
    GpuPreprocessor,
    cupy_status,
    gpu_preprocessor_for,
    item_shape,
    kernel_source,
    launch_grid,
    preprocess_choice,
)
from agent.camera.preprocess import channel_gain_bias, preprocess
from agent.camera.source import VideoSource
from agent.camera.source_spec import FileSourceSpec
from agent.demo.setup import write_demo_video
from agent.errors import EngineError
from agent.specs.preprocess import PreprocessSpec
from tests.camera import kernel_on_cpu
from tests.camera.specs import make
from tests.waiting import patient

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def _spec(**fields: Any) -> PreprocessSpec:
    return PreprocessSpec.model_validate(fields)


# --- decisions, everywhere -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "layout", "index", "store"),
    [
        ("float32", "nchw", "((long long)k * out_h + y) * out_w + x", "__fsub_rn(__fmul_rn"),
        ("float16", "nhwc", "((long long)y * out_w + x) * 3 + k", "f32_to_f16("),
        ("uint8", "nchw", "((long long)k * out_h + y) * out_w + x", "(unsigned char)v"),
    ],
)
def test_kernel_source_writes_the_layout_and_dtype_asked(
    dtype: str, layout: str, index: str, store: str
) -> None:
    code, name = kernel_source(dtype, layout)
    assert name == f"preprocess_{dtype}_{layout}"
    assert f'extern "C" __global__ void {name}(' in code
    assert f"const long long at = {index};" in code
    assert f"dst[at] = {store}" in code
    for placeholder in ("NAME", "OUT_T", "INDEX", "STORE"):
        assert placeholder not in code


def test_kernel_source_refuses_what_it_cannot_write() -> None:
    with pytest.raises(EngineError, match="cannot write 'int8'"):
        kernel_source("int8", "nchw")
    with pytest.raises(EngineError, match="cannot lay out 'chw'"):
        kernel_source("float32", "chw")


def test_launch_grid_covers_every_pixel_once() -> None:
    assert launch_grid(640, 640) == (20, 80, 1)
    gx, gy, _ = launch_grid(641, 9)
    assert (gx * BLOCK[0], gy * BLOCK[1]) == (672, 16)
    assert (gx - 1) * BLOCK[0] < 641
    assert (gy - 1) * BLOCK[1] < 9


def test_item_shape_follows_the_layout() -> None:
    assert item_shape(_spec(width=640, height=480, layout="nchw")) == (3, 480, 640)
    assert item_shape(_spec(width=640, height=480, layout="nhwc")) == (480, 640, 3)


def test_gpu_preprocessing_for_tensorrt_on_a_cuda_device_when_cupy_works() -> None:
    def ok() -> tuple[bool, str]:
        return True, "CuPy 13.3.0, 1 CUDA device(s)"

    for device in ("gpu", "dla0"):
        choice = preprocess_choice({"backend": "tensorrt", "device": device}, ok)
        assert choice.where == "gpu"
        assert "CuPy 13.3.0" in choice.reason


def test_cpu_preprocessing_with_the_reason_otherwise() -> None:
    asked: list[str] = []

    def ok() -> tuple[bool, str]:
        asked.append("cupy")
        return True, "CuPy 13.3.0, 1 CUDA device(s)"

    ort = preprocess_choice({"backend": "onnxruntime", "providers": ["CUDAExecutionProvider"]}, ok)
    assert (ort.where, ort.reason) == (
        "cpu",
        "the onnxruntime runner takes host arrays; GPU preprocessing feeds TensorRT engines only",
    )
    cpu = preprocess_choice({"backend": "tensorrt", "device": "cpu"}, ok)
    assert cpu.where == "cpu"
    assert "not a CUDA device" in cpu.reason
    assert asked == [], "CuPy is not even imported for an engine that cannot use it"
    missing = preprocess_choice(
        {"backend": "tensorrt", "device": "gpu"}, lambda: (False, "CuPy is not installed: ...")
    )
    assert missing == type(missing)("cpu", "GPU preprocessing unavailable: CuPy is not installed: ...")


def test_here_cupy_is_reported_missing_with_the_install_hint() -> None:
    ok, why = cupy_status()
    if ok:
        pytest.skip("CuPy works on this machine")
    assert "gpu-preprocess extra" in why or "no CUDA device" in why
    with pytest.raises(EngineError, match=why.split(":")[0]):
        GpuPreprocessor(_spec())
    preprocessor, choice = gpu_preprocessor_for({"backend": "tensorrt", "device": "gpu"}, _spec())
    assert preprocessor is None
    assert choice.where == "cpu"
    assert choice.reason == f"GPU preprocessing unavailable: {why}"


def _frame(height: int, width: int, seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


CASES = [
    (1080, 1920, {"width": 640, "height": 640, "resize": "letterbox"}),
    (1080, 1920, {"width": 640, "height": 384, "resize": "stretch"}),
    (480, 640, {"width": 224, "height": 224, "color": "bgr", "layout": "nhwc", **IMAGENET}),
    (217, 333, {"width": 160, "height": 96, "resize": "letterbox", "dtype": "float16", **IMAGENET}),
    (70, 100, {"width": 224, "height": 224, "layout": "nhwc", "dtype": "float16"}),
    (720, 1280, {"width": 320, "height": 320, "resize": "letterbox", "dtype": "uint8", "color": "bgr"}),
    (360, 640, {"width": 640, "height": 360, "layout": "nhwc", "dtype": "uint8"}),
    (5, 7, {"width": 32, "height": 32, "resize": "letterbox", "pad_value": 0}),
]


@pytest.mark.parametrize(("height", "width", "fields"), CASES)
def test_the_kernel_source_run_on_the_cpu_equals_the_cpu_path_exactly(
    height: int, width: int, fields: dict[str, Any], tmp_path: Path
) -> None:
    """The CUDA source itself, compiled as C++ (tests/camera/kernel_on_cpu.py): arithmetic, taps,
    padding, channel order, layout and dtype equal agent.camera.preprocess bit for bit."""
    if kernel_on_cpu.compiler() is None:
        pytest.skip("g++ missing: apt-get install g++")
    spec = _spec(**fields)
    frame = _frame(height, width, 5)
    got = kernel_on_cpu.preprocess_on_cpu(frame, spec, tmp_path)
    expected, _ = preprocess(frame, spec)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


# --- on the GPU ------------------------------------------------------------------------------------


@pytest.fixture
def gpu() -> None:
    ok, why = cupy_status()
    if not ok:
        pytest.fail(f"gpu preprocessing tests need CuPy and a CUDA device: {why}")


def _tolerance(spec: PreprocessSpec) -> tuple[float, float]:
    """(one grey level in output units, float rounding) as docs/gpu.md states the contract."""
    if spec.dtype == "uint8":
        return 1.0, 0.0
    grey = max(abs(g) for g in channel_gain_bias(spec)[0])
    rounding = 1e-3 if spec.dtype == "float16" else 1e-5
    return grey, rounding


def _like_the_cpu_path(got: npt.NDArray[Any], frame: npt.NDArray[np.uint8], spec: PreprocessSpec) -> Any:
    """Assert one preprocessed item equals the CPU path's within the kernel's tolerance; its letterbox."""
    grey, rounding = _tolerance(spec)
    expected, letterbox = preprocess(frame, spec)
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    scale = np.maximum(1.0, np.abs(expected.astype(np.float64)))
    assert float(diff.max()) <= grey + rounding * float(scale.max()), spec
    # The fixed-point resize matches OpenCV's, so (nearly) every value differs by rounding only.
    within_rounding = float((diff <= rounding * scale).mean())
    assert within_rounding >= 0.999, (spec, within_rounding)
    return letterbox


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize(("height", "width", "fields"), CASES)
def test_gpu_tensor_equals_the_cpu_path(height: int, width: int, fields: dict[str, Any]) -> None:
    spec = _spec(**fields)
    frames = [_frame(height, width, seed) for seed in range(3)]
    tensor, boxes = GpuPreprocessor(spec).batch(frames)
    got = tensor.get()
    assert got.shape == (3, *item_shape(spec))
    assert got.dtype == np.dtype(spec.dtype)
    for i, frame in enumerate(frames):
        assert boxes[i] == _like_the_cpu_path(got[i], frame, spec)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_a_batch_of_page_locked_and_pageable_frames_of_three_sizes_equals_the_cpu_path() -> None:
    """Two device buffers take turns and each frame's upload overlaps the kernel before it: a
    buffer written while a kernel still read it, or a kernel reading before its upload, shows here."""
    spec = _spec(width=640, height=640, resize="letterbox")
    gpu = GpuPreprocessor(spec)
    sizes = [(1080, 1920), (1080, 1920), (480, 640), (1080, 1920), (720, 1280), (720, 1280), (480, 640)]
    frames = [_frame(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    batch = []
    for i, frame in enumerate(frames):
        if i % 2 == 0:
            locked = gpu.pinned.empty(frame.shape)
            locked[...] = frame
            batch.append(locked)
        else:
            batch.append(frame)
    before = (gpu.uploads_pinned, gpu.uploads_pageable)

    tensor, _ = gpu.batch(batch)
    again, _ = gpu.batch(batch)  # the buffers' second turn, after a batch ended
    got, got_again = tensor.get(), again.get()

    for i, frame in enumerate(frames):
        _like_the_cpu_path(got[i], frame, spec)
        _like_the_cpu_path(got_again[i], frame, spec)
    assert (gpu.uploads_pinned - before[0], gpu.uploads_pageable - before[1]) == (8, 6)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_a_sources_frames_land_in_page_locked_buffers_and_are_uploaded_from_them(tmp_path: Path) -> None:
    import cupy

    spec = _spec(width=640, height=640, resize="letterbox")
    gpu = GpuPreprocessor(spec)
    clip = write_demo_video(tmp_path / "clip.avi", frames=12, size=(1920, 1080), fps=30.0)
    source = VideoSource("cam", make(FileSourceSpec, path=clip, loop=False))
    locked = 0
    for frame in source.frames(threading.Event()):
        if frame.index == 0:
            source.decode_into(gpu.pinned.empty)  # what the capture stage does on the GPU path
        tensor, _ = gpu.batch([frame.image])
        _like_the_cpu_path(tensor.get()[0], frame.image, spec)
        if gpu.pinned.holds(frame.image):
            locked += 1
            # Page-locked as CUDA itself sees it (cudaMemoryTypeHost), not only by our bookkeeping.
            attributes = cupy.cuda.runtime.pointerGetAttributes(frame.image.ctypes.data)
            assert attributes.type == 1
    assert locked >= 12 - 4  # all but the first few, made while the pool grew
    assert gpu.uploads_pinned == locked


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_1080p_into_640x640_timings_cpu_path_vs_gpu_path() -> None:
    """The issue's figure, in one run: CPU path ms vs GPU path host ms and GPU (event) ms, as JSON."""
    # The bench script itself, as it is run there by hand: one JSON line.
    root = Path(__file__).parents[2]
    # The script's own directory is its sys.path[0]: the checkout's agent/ comes from PYTHONPATH.
    paths = [str(root), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "preprocess_gpu.py"), "--runs", "50"],
        capture_output=True,
        text=True,
        timeout=patient(300),
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(figures))
    assert figures["cpu_path_ms"] > 0
    assert figures["gpu_path_host_ms"] > 0
    assert figures["gpu_device_ms"] > 0
