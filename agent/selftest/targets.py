"""Which devices the self-test builds engines for on this platform, and each step's budget (pure).

A device is usable when a backend here can build for it: TensorRT for ``gpu``, ``dla0`` and ``dla1``
(a DLA core only where TensorRT reports it), ONNX Runtime with a CUDA or TensorRT provider for ``gpu``
when TensorRT itself is absent, ONNX Runtime for ``cpu``. Every unusable device carries the reason
its steps are skipped with.

Budgets are seconds on an AGX Orin 64 GB at MAXN (JetPack 6) for the bundled shapes model (64x64
input), chosen so the whole run stays under :data:`TOTAL_BUDGET_S`; a step over its budget is
reported, not failed, because they are an Orin's figures, not this machine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.machine.platform import Platform

#: ONNX Runtime providers that run on the GPU, best first.
ORT_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")

Device = Literal["gpu", "dla0", "dla1", "cpu"]
EnginePrecision = Literal["fp16", "int8"]

DEVICES: tuple[Device, ...] = ("gpu", "dla0", "dla1", "cpu")
PRECISIONS: tuple[EnginePrecision, ...] = ("fp16", "int8")

#: The whole self-test on an AGX Orin, the sum of every step's budget at most.
TOTAL_BUDGET_S = 600.0

#: Engine build budget per device and precision (TensorRT builds are the slow part; DLA slowest).
BUILD_BUDGET_S: dict[tuple[Device, EnginePrecision], float] = {
    ("gpu", "fp16"): 40.0,
    ("gpu", "int8"): 60.0,
    ("dla0", "fp16"): 45.0,
    ("dla0", "int8"): 60.0,
    ("dla1", "fp16"): 45.0,
    ("dla1", "int8"): 60.0,
    ("cpu", "fp16"): 15.0,
    ("cpu", "int8"): 30.0,
}

#: Budgets of the other steps.
BUDGET_S: dict[str, float] = {
    "platform": 5.0,
    "cache": 5.0,  # per engine: a second build that must be a cache hit
    "throughput": 10.0,  # per engine
    "compare.backends": 40.0,
    "fleet.downloaded_engine": 5.0,
    "multi_engine.slot": 30.0,
    "hotswap.synthetic_stream": 20.0,
    "telemetry.sysfs": 5.0,
    "cuda.buffers": 5.0,
    "cuda.leak_check": 15.0,
}


@dataclass(frozen=True)
class DeviceTarget:
    """A device the self-test would build for: usable or not, the backend, and why."""

    device: Device
    usable: bool
    reason: str


def device_targets(platform: Platform) -> list[DeviceTarget]:
    """Every device in :data:`DEVICES` order, each usable here or not with the reason."""
    trt = platform.backends.get("tensorrt")
    trt_ok = trt is not None and trt.usable
    trt_why = trt.reason if trt is not None else "TensorRT not probed"
    ort = platform.backends.get("onnxruntime")
    ort_ok = ort is not None and ort.usable
    providers = ", ".join(platform.ort_providers) or "none"
    ort_gpu = [
        p for p in platform.ort_providers if p in ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    ]

    targets = []
    if trt_ok:
        targets.append(DeviceTarget("gpu", True, f"TensorRT {platform.tensorrt_version}"))
    elif ort_ok and ort_gpu:
        targets.append(DeviceTarget("gpu", True, f"no TensorRT ({trt_why}); ONNX Runtime {ort_gpu[0]}"))
    else:
        targets.append(
            DeviceTarget(
                "gpu",
                False,
                f"no GPU engine backend: {trt_why}; "
                f"ONNX Runtime has no CUDA or TensorRT provider ({providers})",
            )
        )
    cores = platform.dla_cores or 0
    for core in (0, 1):
        device: Device = "dla0" if core == 0 else "dla1"
        if not trt_ok:
            targets.append(DeviceTarget(device, False, f"DLA needs TensorRT: {trt_why}"))
        elif core >= cores:
            plural = "" if cores == 1 else "s"
            targets.append(DeviceTarget(device, False, f"this device has {cores} DLA core{plural}"))
        else:
            targets.append(
                DeviceTarget(device, True, f"TensorRT {platform.tensorrt_version}, DLA core {core}")
            )
    if ort_ok:
        targets.append(DeviceTarget("cpu", True, f"ONNX Runtime {platform.onnxruntime_version}"))
    else:
        targets.append(
            DeviceTarget("cpu", False, ort.reason if ort is not None else "onnxruntime not probed")
        )
    return targets


def total_budget_s() -> float:
    """Sum of every step's budget when every device is usable: the self-test's bound on an Orin."""
    engines = len(BUILD_BUDGET_S)
    per_engine = BUDGET_S["cache"] + BUDGET_S["throughput"]
    others = sum(v for k, v in BUDGET_S.items() if k not in ("cache", "throughput"))
    return sum(BUILD_BUDGET_S.values()) + engines * per_engine + others
