"""The device steps: platform facts, telemetry read from this device's sysfs, and the CUDA buffers
and leak check TensorRT runs on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from agent.machine.platform import platform_summary
from agent.selftest.run import INPUT_SIZE, LEAK_TOLERANCE_BYTES, SelfTestRun
from agent.selftest.step import Passed, Skipped, StepFailure
from agent.telemetry import DeviceStats

# --------------------------------------------------------------------------- platform


def platform_step(run: SelfTestRun) -> Passed:
    """The facts every later step depends on, and which devices they make usable."""
    p = run.platform
    usable = [t.device for t in run.targets if t.usable]
    detail = (
        f"{p.device_model or p.machine or 'unknown machine'}; jetson {p.is_jetson}, L4T {p.l4t_release}, "
        f"JetPack {p.jetpack}, CUDA {p.cuda_runtime}, GPU {p.gpu_name}, DLA cores {p.dla_cores}, "
        f"TensorRT {p.tensorrt_version}, ONNX Runtime {p.onnxruntime_version}; "
        f"devices to test: {', '.join(usable) or 'none'}"
    )
    data = {
        "summary": platform_summary(p),
        "targets": [{"device": t.device, "usable": t.usable, "reason": t.reason} for t in run.targets],
    }
    return Passed(detail, data)


# --------------------------------------------------------------------------- engines


# --------------------------------------------------------------------------- telemetry, CUDA

#: Fields a Jetson's sysfs gives the agent (temperatures are ``temp.*``).
JETSON_FIELDS = ("gpu.load_percent", "gpu.freq_mhz")
DLA_CLOCK_FIELDS = ("dla0.freq_mhz", "dla1.freq_mhz")


def telemetry_step(run: SelfTestRun, root: Path = Path("/")) -> Passed:
    """Read the device statistics telemetry publishes; on a Jetson, GPU load and clock must be there."""
    stats = DeviceStats(root)
    time.sleep(0.2)  # cpu_percent measures since the previous call
    values = stats.collect()
    temps = sorted(k for k in values if k.startswith("temp."))
    present = [k for k in (*JETSON_FIELDS, *DLA_CLOCK_FIELDS, "emc.freq_mhz") if k in values]
    data: dict[str, Any] = {"fields": values}
    if not run.platform.is_jetson:
        raise Skipped(
            f"not a Jetson ({run.platform.reasons.get('l4t_release', 'no L4T release')}): no GPU/DLA sysfs "
            f"here; read {len(values)} fields ({len(temps)} temperatures)"
        )
    missing = [k for k in JETSON_FIELDS if k not in values]
    if not temps:
        missing.append("temp.*")
    if missing:
        raise StepFailure(f"not found in sysfs: {', '.join(missing)}", data)
    dla = [k for k in DLA_CLOCK_FIELDS if k in values]
    dla_note = (
        ", ".join(f"{k} {values[k]:.0f}" for k in dla)
        if dla
        else "DLA clocks unreadable (debugfs needs root)"
    )
    detail = (
        f"{len(temps)} temperatures ({', '.join(f'{k} {values[k]:.1f}' for k in temps[:4])}), "
        f"GPU load {values['gpu.load_percent']:.1f} %, GPU {values['gpu.freq_mhz']:.0f} MHz, {dla_note}"
    )
    data["present"] = present
    return Passed(detail, data)


def _cuda() -> Any:
    from agent.backends import cuda

    usable, why = cuda.cuda_status()
    if not usable:
        raise Skipped(why)
    return cuda


def cuda_buffers_step(_run: SelfTestRun) -> Passed:
    """Host -> device -> host through pinned buffers and a non-blocking stream, bit for bit."""
    cuda = _cuda()
    checked = 0
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float16, np.uint8, np.int32):
        for shape in ((1,), (1, 3, INPUT_SIZE, INPUT_SIZE), (4, 1 << 18)):
            data = (rng.random(shape) * 100).astype(dtype)
            with (
                cuda.PinnedBuffer(shape, dtype) as src,
                cuda.PinnedBuffer(shape, dtype) as dst,
                cuda.DeviceBuffer(data.nbytes) as dev,
                cuda.Stream() as stream,
            ):
                src.array[...] = data
                dst.array[...] = 0
                cuda.copy_htod_async(dev, src.array, stream)
                cuda.copy_dtoh_async(dst.array, dev, stream)
                stream.synchronize()
                if not np.array_equal(dst.array, data):
                    raise StepFailure(f"round trip of {dtype.__name__} {shape} came back different")
            checked += 1
    free, total = cuda.mem_get_info()
    return Passed(
        f"{checked} round trips (4 dtypes x 3 shapes) equal bit for bit; "
        f"device memory {free / 2**20:.0f} of {total / 2**20:.0f} MiB free",
        {"round_trips": checked, "free_bytes": free, "total_bytes": total},
    )


def cuda_leak_step(run: SelfTestRun) -> Passed:
    """Allocate / copy / free 1 MiB buffers many times: free device memory must not drop."""
    cuda = _cuda()
    nbytes = 1 << 20
    data = np.arange(nbytes // 4, dtype=np.float32)
    cycles = run.sizes.leak_cycles

    def cycle(stream: Any) -> None:
        with cuda.DeviceBuffer(nbytes) as dev, cuda.PinnedBuffer(data.shape, data.dtype) as host:
            cuda.copy_htod_async(dev, data, stream)
            cuda.copy_dtoh_async(host.array, dev, stream)
            stream.synchronize()

    with cuda.Stream() as stream:
        cycle(stream)  # first touch: lets the allocator and context settle before measuring
        free_before, total = cuda.mem_get_info()
        for _ in range(cycles):
            cycle(stream)
        free_after, _ = cuda.mem_get_info()
    leaked = free_before - free_after
    data_out = {"cycles": cycles, "free_before": free_before, "free_after": free_after, "total": total}
    line = (
        f"{cycles} cycles of 1 MiB: free {free_before / 2**20:.1f} -> {free_after / 2**20:.1f} MiB "
        f"of {total / 2**20:.0f} (difference {leaked / 2**20:.2f} MiB)"
    )
    if leaked >= LEAK_TOLERANCE_BYTES:
        raise StepFailure(f"device memory leaks: {line}", data_out)
    return Passed(line, data_out)
