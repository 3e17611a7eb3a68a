"""The GPU preprocessing kernel's CUDA source compiled as C++ and run on the CPU (no GPU here).

Stands in for the GPU, which this machine lacks: the very source string the agent hands to NVRTC
(:func:`agent.camera.gpu_preprocess.kernel_source`) is compiled with g++ after a few textual
stand-ins for CUDA built-ins (``blockIdx``/``threadIdx`` set by a loop over every block and thread
of the launch grid, ``__fmul_rn``/``__fsub_rn`` as separately rounded float operations, the PTX
half conversion as a C++ ``_Float16`` cast, both round-to-nearest-even). What it checks is the
kernel's arithmetic, indexing and layout; the ``gpu`` tests check the same on a real GPU.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.camera.gpu_preprocess import BLOCK, item_shape, kernel_source, launch_grid
from agent.camera.linear_taps import linear_taps
from agent.camera.preprocess import channel_gain_bias, channel_sources, resize_fit
from agent.specs.preprocess import PreprocessSpec
from tests.waiting import patient

_PRELUDE = r"""
#include <cstring>
struct Index3 { int x, y, z; };
static Index3 blockIdx, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
"""

_HALF = (
    "static inline unsigned short f32_to_f16(float f) "
    "{ _Float16 h = (_Float16)f; unsigned short u; memcpy(&u, &h, 2); return u; }\n"
)


def compiler() -> str | None:
    """g++ when installed."""
    return shutil.which("g++")


def build(dtype: str, layout: str, workdir: Path) -> Callable[..., Any]:
    """The kernel for ``dtype``/``layout`` as a C function ``run(grid_x, grid_y, <kernel args>)``."""
    code, name = kernel_source(dtype, layout)
    code, swapped = re.subn(
        r"__device__ __forceinline__ unsigned short f32_to_f16\(float f\) \{.*?\n\}\n",
        _HALF,
        code,
        flags=re.S,
    )
    assert swapped == 1, "the kernel's half conversion changed: update the stand-in"
    code = code.replace('extern "C" __global__ void', "static void")
    params = code[code.index(name + "(") + len(name) + 1 : code.index(")\n{")]
    args = ", ".join(p.split()[-1].lstrip("*") for p in params.split(","))
    bx, by, _ = BLOCK
    launcher = f"""
extern "C" void run(int grid_x, int grid_y, {params}) {{
    blockDim = {{{bx}, {by}, 1}};
    for (int gy = 0; gy < grid_y; ++gy) for (int gx = 0; gx < grid_x; ++gx)
        for (int ty = 0; ty < {by}; ++ty) for (int tx = 0; tx < {bx}; ++tx) {{
            blockIdx = {{gx, gy, 0}};
            threadIdx = {{tx, ty, 0}};
            {name}({args});
        }}
}}
"""
    source = workdir / f"{name}.cpp"
    library = workdir / f"{name}.so"
    source.write_text(_PRELUDE + code + launcher)
    subprocess.run(
        ["g++", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
        timeout=patient(120),
    )
    run: Callable[..., Any] = ctypes.CDLL(str(library)).run
    return run


def preprocess_on_cpu(image: npt.NDArray[np.uint8], spec: PreprocessSpec, workdir: Path) -> npt.NDArray[Any]:
    """One frame through the compiled kernel, with the arguments GpuPreprocessor passes."""
    run = build(spec.dtype, spec.layout, workdir)
    height, width = image.shape[:2]
    fit = resize_fit(width, height, spec)
    taps = linear_taps(width, height, fit.new_w, fit.new_h)
    tables = [
        np.ascontiguousarray(a, dtype=np.int32)
        for a in (
            taps.columns.first,
            taps.columns.second,
            taps.columns.weight_first,
            taps.columns.weight_second,
            taps.rows.first,
            taps.rows.second,
            taps.rows.weight_first,
            taps.rows.weight_second,
        )
    ]
    out = np.empty(item_shape(spec), dtype=np.dtype(spec.dtype))
    gain, bias = channel_gain_bias(spec)
    frame = np.ascontiguousarray(image)
    grid_x, grid_y, _ = launch_grid(spec.width, spec.height)
    i32, f32, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    run(
        i32(grid_x),
        i32(grid_y),
        ptr(frame.ctypes.data),
        i32(width * 3),
        *(ptr(t.ctypes.data) for t in tables),
        *(i32(v) for v in (fit.new_w, fit.new_h, fit.left, fit.top, spec.width, spec.height, spec.pad_value)),
        *(i32(c) for c in channel_sources(spec)),
        *(f32(g) for g in gain),
        *(f32(b) for b in bias),
        ptr(out.ctypes.data),
    )
    return out
