"""What this machine is: Jetson or not, L4T/JetPack, CUDA, GPU, DLA cores, TensorRT, ONNX Runtime.

:func:`detect_platform` runs every probe in isolation: a probe that fails (file missing, library
absent, no driver) leaves its fields ``None`` and records a one-line reason in
:attr:`Platform.reasons`; it never raises. The result feeds the build planner
(:mod:`agent.engines.building.plan`), the engine cache key and the retained ``up/info`` message.

Heavy libraries (``tensorrt``, ``cuda``, ``onnxruntime``) are imported lazily inside the probes, so
importing this module costs nothing.

One job, detection: each probe (CUDA, TensorRT, ONNX Runtime, and the Jetson's files in
:mod:`agent.machine.jetson_files`) carries its own failure reasons, and they share one result type.
"""

from __future__ import annotations

import importlib
import platform as host_platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import structlog

from agent.machine.jetson_files import SOC_FACTS, probe_jetson_files

log = structlog.get_logger(__name__)


class BackendAvailability(NamedTuple):
    """Whether a backend can run here, and the one-line reason (why not, or what it found)."""

    usable: bool
    reason: str


@dataclass(frozen=True)
class Platform:
    """Facts about this machine. ``None`` means "not found"; :attr:`reasons` says why, per field."""

    is_jetson: bool = False
    machine: str | None = None
    l4t_release: str | None = None
    jetpack: str | None = None
    device_model: str | None = None
    #: Tegra SoC from the device tree (``tegra234`` = Orin, ``tegra264`` = Thor); see :data:`SOC_FACTS`.
    soc: str | None = None
    cuda_driver: str | None = None
    cuda_runtime: str | None = None
    gpu_name: str | None = None
    compute_capability: str | None = None
    dla_cores: int | None = None
    tensorrt_version: str | None = None
    onnxruntime_version: str | None = None
    ort_providers: tuple[str, ...] = ()
    backends: dict[str, BackendAvailability] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def soc_family(self) -> str | None:
        """``Orin``, ``Thor``, ... for a known :attr:`soc`, else None."""
        facts = SOC_FACTS.get(self.soc or "")
        return facts[0] if facts else None

    @property
    def soc_has_dla(self) -> bool | None:
        """False on a chip without DLA (Thor), True on one with DLA, None when the chip is unknown."""
        facts = SOC_FACTS.get(self.soc or "")
        return facts[1] > 0 if facts else None

    @property
    def has_gpu(self) -> bool:
        """A CUDA GPU answered, or this is a Jetson (every Jetson has an integrated GPU)."""
        return self.gpu_name is not None or self.is_jetson


# --------------------------------------------------------------------------- probes


def cuda_version_string(version: int) -> str:
    """CUDA's integer version (``12060``) as ``'12.6'``."""
    return f"{version // 1000}.{(version % 1000) // 10}"


@dataclass
class _Probe:
    """Accumulates field values and reasons while :func:`detect_platform` runs."""

    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def run(self, name: str, fields: tuple[str, ...], probe: Callable[[], dict[str, Any]]) -> None:
        """Run one probe; on any exception its fields stay None and the reason names the exception."""
        try:
            self.values.update(probe())
        except Exception as exc:  # noqa: BLE001 - a broken probe must never stop the agent
            reason = f"{name} probe failed: {type(exc).__name__}: {exc}"
            log.warning("platform.probe.failed", probe=name, error=reason)
            for name_ in fields:
                self.values.pop(name_, None)
                self.reasons.setdefault(name_, reason)


def _cuda_error_name(cudart: Any, err: Any) -> str:
    try:
        _, name = cudart.cudaGetErrorName(err)
        if isinstance(name, bytes):
            return name.decode(errors="replace")
        return str(name)
    except Exception:  # noqa: BLE001 - only naming the error; fall back to the enum's own name
        return str(getattr(err, "name", err))


def probe_cuda(cudart: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Driver/runtime version, GPU name and compute capability through a cuda-python ``cudart`` module.

    Every cuda-python call returns ``(err, *values)``; without a driver they return
    ``cudaErrorInsufficientDriver`` (or ``cudaErrorNoDevice``) and the field stays None with that name.
    """
    values: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    success = cudart.cudaError_t.cudaSuccess

    err, version = cudart.cudaDriverGetVersion()
    if err != success or not version:
        # The call succeeds with 0 when no driver is installed.
        reasons["cuda_driver"] = (
            f"cudaDriverGetVersion: {_cuda_error_name(cudart, err)}" if err != success else "no CUDA driver"
        )
    else:
        values["cuda_driver"] = cuda_version_string(int(version))

    err, version = cudart.cudaRuntimeGetVersion()
    if err != success:
        reasons["cuda_runtime"] = f"cudaRuntimeGetVersion: {_cuda_error_name(cudart, err)}"
    else:
        values["cuda_runtime"] = cuda_version_string(int(version))

    err, props = cudart.cudaGetDeviceProperties(0)
    if err != success:
        reason = f"cudaGetDeviceProperties(0): {_cuda_error_name(cudart, err)}"
        reasons["gpu_name"] = reasons["compute_capability"] = reason
    else:
        name = props.name
        if isinstance(name, bytes):
            name = name.split(b"\x00", 1)[0].decode(errors="replace")
        values["gpu_name"] = str(name).strip()
        values["compute_capability"] = f"{int(props.major)}.{int(props.minor)}"
    return values, reasons


def probe_tensorrt(trt: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """TensorRT version and DLA core count from an imported ``tensorrt`` module.

    ``import tensorrt`` succeeds as an empty namespace package where only ``tensorrt-stubs`` is
    installed, so the module counts as TensorRT only when it has ``Builder``. Creating a Builder
    initialises CUDA; on a machine without a GPU that fails and ``dla_cores`` stays None.
    """
    values: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    if not hasattr(trt, "Builder"):
        reason = "tensorrt is not installed (only type stubs or an empty package found)"
        reasons["tensorrt_version"] = reasons["dla_cores"] = reason
        return values, reasons
    values["tensorrt_version"] = str(getattr(trt, "__version__", "")) or None
    if values["tensorrt_version"] is None:
        reasons["tensorrt_version"] = "tensorrt has no __version__"
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
        values["dla_cores"] = int(builder.num_DLA_cores)
    except Exception as exc:  # noqa: BLE001 - no GPU or a broken install: report, don't crash
        reasons["dla_cores"] = f"tensorrt.Builder failed: {type(exc).__name__}: {exc}"
    return values, reasons


def probe_onnxruntime(ort: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """ONNX Runtime version and its available execution providers."""
    return {
        "onnxruntime_version": str(ort.__version__),
        "ort_providers": tuple(str(p) for p in ort.get_available_providers()),
    }, {}


def _import_optional(*names: str) -> tuple[ModuleType | None, str]:
    """Import the first of ``names`` that imports; else None and why (one line)."""
    errors = []
    for name in names:
        try:
            return importlib.import_module(name), ""
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library
            errors.append(
                str(exc) if isinstance(exc, ImportError) else f"{name}: {type(exc).__name__}: {exc}"
            )
    return None, "; ".join(dict.fromkeys(errors))  # dedupe: both cuda names fail on "No module named 'cuda'"


def _load_cudart() -> tuple[ModuleType | None, str]:
    # cuda-python 12.6+ has cuda.bindings.runtime; the old cuda.cudart is gone in 13.0.
    return _import_optional("cuda.bindings.runtime", "cuda.cudart")


def _load_tensorrt() -> tuple[ModuleType | None, str]:
    return _import_optional("tensorrt")


def _load_onnxruntime() -> tuple[ModuleType | None, str]:
    return _import_optional("onnxruntime")


def _module_probe(
    loader: Callable[[], tuple[ModuleType | None, str]],
    probe: Callable[[Any], tuple[dict[str, Any], dict[str, str]]],
    fields: tuple[str, ...],
    missing: str,
    reasons: dict[str, str],
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        module, why = loader()
        if module is None:
            for name in fields:
                reasons.setdefault(name, f"{missing} ({why})")
            return {}
        values, probe_reasons = probe(module)
        for name, reason in probe_reasons.items():
            reasons.setdefault(name, reason)
        return values

    return run


def _backends(values: dict[str, Any], reasons: dict[str, str]) -> dict[str, BackendAvailability]:
    has_gpu = values.get("gpu_name") is not None or bool(values.get("is_jetson"))
    trt_version = values.get("tensorrt_version")
    if trt_version is None:
        trt = BackendAvailability(False, reasons.get("tensorrt_version", "tensorrt not found"))
    elif not has_gpu:
        trt = BackendAvailability(
            False, f"TensorRT {trt_version} found but no CUDA GPU: {reasons.get('gpu_name', 'none')}"
        )
    else:
        trt = BackendAvailability(True, f"TensorRT {trt_version}, DLA cores: {values.get('dla_cores')}")
    ort_version = values.get("onnxruntime_version")
    if ort_version is None:
        ort = BackendAvailability(False, reasons.get("onnxruntime_version", "onnxruntime not found"))
    else:
        providers = ", ".join(values.get("ort_providers", ())) or "none"
        ort = BackendAvailability(True, f"ONNX Runtime {ort_version}, providers: {providers}")
    return {"tensorrt": trt, "onnxruntime": ort}


def detect_platform(root: Path = Path("/")) -> Platform:
    """Probe this machine. Never raises: a failing probe leaves its fields None with a reason.

    ``root`` is where ``etc/nv_tegra_release`` and ``proc/device-tree`` are read from; tests point
    it at a temporary directory dressed as a Jetson because no Jetson hardware is available there.
    """
    probe = _Probe()
    reasons = probe.reasons

    def jetson_files() -> dict[str, Any]:
        values, found_reasons = probe_jetson_files(root)
        reasons.update(found_reasons)
        return values

    probe.run("machine", ("machine",), lambda: {"machine": host_platform.machine() or None})
    probe.run("jetson", ("is_jetson", "l4t_release", "jetpack", "device_model", "soc"), jetson_files)
    cuda_fields = ("cuda_driver", "cuda_runtime", "gpu_name", "compute_capability")
    probe.run(
        "cuda",
        cuda_fields,
        _module_probe(_load_cudart, probe_cuda, cuda_fields, "cuda-python not installed", reasons),
    )
    trt_fields = ("tensorrt_version", "dla_cores")
    probe.run(
        "tensorrt",
        trt_fields,
        _module_probe(_load_tensorrt, probe_tensorrt, trt_fields, "tensorrt not importable", reasons),
    )
    ort_fields = ("onnxruntime_version", "ort_providers")
    probe.run(
        "onnxruntime",
        ort_fields,
        _module_probe(
            _load_onnxruntime, probe_onnxruntime, ort_fields, "onnxruntime not importable", reasons
        ),
    )
    values = probe.values
    # A field with a value has no reason to be missing (a later fallback may have found it).
    missing_reasons = {k: v for k, v in reasons.items() if values.get(k) is None}
    return Platform(
        is_jetson=bool(values.get("is_jetson", False)),
        machine=values.get("machine"),
        l4t_release=values.get("l4t_release"),
        jetpack=values.get("jetpack"),
        device_model=values.get("device_model"),
        soc=values.get("soc"),
        cuda_driver=values.get("cuda_driver"),
        cuda_runtime=values.get("cuda_runtime"),
        gpu_name=values.get("gpu_name"),
        compute_capability=values.get("compute_capability"),
        dla_cores=values.get("dla_cores"),
        tensorrt_version=values.get("tensorrt_version"),
        onnxruntime_version=values.get("onnxruntime_version"),
        ort_providers=tuple(values.get("ort_providers", ())),
        backends=_backends(values, missing_reasons),
        reasons=missing_reasons,
    )


SummaryValue = str | int | float | bool | None


def platform_summary(p: Platform) -> dict[str, SummaryValue]:
    """Flat key -> scalar view for ``up/info`` and ``edge-agent info``.

    Backends appear as ``backend_<key>`` (usable) and ``backend_<key>_reason``; every field that is
    None gets ``<field>_reason`` saying why.
    """
    summary: dict[str, SummaryValue] = {
        "is_jetson": p.is_jetson,
        "machine": p.machine,
        "device_model": p.device_model,
        "soc": p.soc,
        "soc_family": p.soc_family,
        "l4t_release": p.l4t_release,
        "jetpack": p.jetpack,
        "cuda_driver": p.cuda_driver,
        "cuda_runtime": p.cuda_runtime,
        "gpu_name": p.gpu_name,
        "compute_capability": p.compute_capability,
        "dla_cores": p.dla_cores,
        "tensorrt_version": p.tensorrt_version,
        "onnxruntime_version": p.onnxruntime_version,
        "ort_providers": ",".join(p.ort_providers),
    }
    for name in list(summary):
        if summary[name] is None and name in p.reasons:
            summary[f"{name}_reason"] = p.reasons[name]
    for key, availability in sorted(p.backends.items()):
        summary[f"backend_{key}"] = availability.usable
        summary[f"backend_{key}_reason"] = availability.reason
    return summary
