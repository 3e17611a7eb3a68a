"""Platform detection: L4T/JetPack parsing, probes isolated from each other, the flat summary.

No Jetson, CUDA GPU or TensorRT exists on the test machines: a temporary directory dressed as a
Jetson root stands in for ``/etc`` and ``/proc/device-tree``, and small fake ``cudart``/``tensorrt``
modules stand in for the libraries, reproducing their documented return conventions. ONNX Runtime
is real.
"""

from __future__ import annotations

import enum
import importlib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import onnxruntime
import pytest

import agent.machine.platform as platform_mod
from agent.machine.jetson_files import L4T_TO_JETPACK, jetpack_for_l4t, parse_tegra_release
from agent.machine.platform import (
    BackendAvailability,
    Platform,
    cuda_version_string,
    detect_platform,
    platform_summary,
    probe_cuda,
    probe_tensorrt,
)

AGX_RELEASE = (
    "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, "
    "DATE: Fri Sep 13 04:36:44 UTC 2024\n"
    "# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n"
    "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n"
)


ORIN_COMPATIBLE = b"nvidia,p3737-0000+p3701-0005\x00nvidia,p3701-0005\x00nvidia,tegra234\x00"
#: Jetson AGX Thor (JetPack 7.0 = L4T R38.2): board ids illustrative, the SoC entry is what counts.
THOR_RELEASE = "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64\n"
THOR_COMPATIBLE = b"nvidia,p3971-0000+p3834-0000\x00nvidia,p3834-0000\x00nvidia,tegra264\x00"


def jetson_root(
    tmp_path: Path,
    release: str = AGX_RELEASE,
    model: bytes | None = None,
    compatible: bytes = ORIN_COMPATIBLE,
) -> Path:
    """A fake filesystem root with the files a Jetson has (hardware absent here)."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text(release)
    dt = tmp_path / "proc/device-tree"
    dt.mkdir(parents=True)
    (dt / "model").write_bytes(model if model is not None else b"NVIDIA Jetson AGX Orin Developer Kit\x00")
    (dt / "compatible").write_bytes(compatible)
    return tmp_path


# --------------------------------------------------------------------------- fakes for absent hardware


class FakeCudaError(enum.IntEnum):
    """Stands in for cuda-python's ``cudaError_t`` (no CUDA here)."""

    cudaSuccess = 0
    cudaErrorNoDevice = 100
    cudaErrorInsufficientDriver = 35


def fake_cudart(*, driver: int = 12060, runtime: int = 12060, error: FakeCudaError | None = None) -> Any:
    """A cuda-python ``cudart`` stand-in: every call returns ``(err, *values)`` like the real one.

    ``error`` makes the driver-dependent calls fail the way they do on a machine without a GPU.
    """
    ok = FakeCudaError.cudaSuccess

    def device_props(index: int) -> tuple[FakeCudaError, Any]:
        if error is not None:
            return error, None
        return ok, SimpleNamespace(name=b"Orin\x00\x00\x00\x00", major=8, minor=7)

    return SimpleNamespace(
        cudaError_t=FakeCudaError,
        cudaDriverGetVersion=lambda: (ok, 0) if error is not None else (ok, driver),
        cudaRuntimeGetVersion=lambda: (ok, runtime),
        cudaGetDeviceProperties=device_props,
        cudaGetErrorName=lambda err: (ok, err.name.encode()),
    )


def fake_tensorrt(version: str = "10.3.0", dla_cores: int = 2, builder_error: Exception | None = None) -> Any:
    """A ``tensorrt`` stand-in with Builder/Logger and ``num_DLA_cores`` (TensorRT absent here)."""

    class Logger:
        ERROR = 1

        def __init__(self, severity: int) -> None:
            self.severity = severity

    class Builder:
        def __init__(self, logger: Logger) -> None:
            if builder_error is not None:
                raise builder_error
            self.num_DLA_cores = dla_cores

    return SimpleNamespace(__version__=version, Builder=Builder, Logger=Logger)


# --------------------------------------------------------------------------- pure parsers


@pytest.mark.parametrize(
    ("text", "release"),
    [
        (AGX_RELEASE, "R36.4.0"),
        (
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug 1",
            "R35.4.1",
        ),
        ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic", "R36.4.3"),
        ("# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t186ref", "R32.7.1"),
        ("garbage", None),
        ("", None),
    ],
    ids=["r36.4.0", "r35.4.1", "r36.4.3", "r32.7.1", "garbage", "empty"],
)
def test_parse_tegra_release(text: str, release: str | None) -> None:
    assert parse_tegra_release(text) == release


@pytest.mark.parametrize(
    ("l4t", "jetpack"),
    [
        ("R35.2.1", "5.1"),
        ("R35.3.1", "5.1.1"),
        ("R35.4.1", "5.1.2"),
        ("R35.5.0", "5.1.3"),
        ("R35.9.9", "5.1.x"),
        ("R36.2.0", "6.0"),
        ("R36.3.0", "6.0"),
        ("R36.4.0", "6.1"),
        ("R36.4.3", "6.2"),
        ("R36.4.4", "6.2.1"),
        ("R36.4.7", "6.1/6.2"),
        ("R36.45.0", None),  # prefix on component boundaries only
        ("R32.7.1", None),
    ],
    ids=str,
)
def test_jetpack_for_l4t(l4t: str, jetpack: str | None) -> None:
    assert jetpack_for_l4t(l4t) == jetpack


def test_jetpack_table_prefixes_are_releases() -> None:
    assert all(prefix.startswith("R") for prefix, _ in L4T_TO_JETPACK)


@pytest.mark.parametrize(
    ("value", "text"), [(12060, "12.6"), (11040, "11.4"), (12020, "12.2"), (13000, "13.0")]
)
def test_cuda_version_string(value: int, text: str) -> None:
    assert cuda_version_string(value) == text


# --------------------------------------------------------------------------- probes


def test_probe_cuda_success() -> None:
    values, reasons = probe_cuda(fake_cudart(driver=12060, runtime=12020))
    assert values == {
        "cuda_driver": "12.6",
        "cuda_runtime": "12.2",
        "gpu_name": "Orin",
        "compute_capability": "8.7",
    }
    assert reasons == {}


def test_probe_cuda_without_driver() -> None:
    values, reasons = probe_cuda(fake_cudart(error=FakeCudaError.cudaErrorInsufficientDriver))
    assert values == {"cuda_runtime": "12.6"}
    assert reasons["cuda_driver"] == "no CUDA driver"
    assert "cudaErrorInsufficientDriver" in reasons["gpu_name"]
    assert "cudaErrorInsufficientDriver" in reasons["compute_capability"]


def test_probe_tensorrt_real_builder() -> None:
    values, reasons = probe_tensorrt(fake_tensorrt("10.3.0", dla_cores=2))
    assert values == {"tensorrt_version": "10.3.0", "dla_cores": 2}
    assert reasons == {}


def test_probe_tensorrt_builder_fails_without_gpu() -> None:
    values, reasons = probe_tensorrt(fake_tensorrt(builder_error=RuntimeError("CUDA initialization failure")))
    assert values == {"tensorrt_version": "10.3.0"}
    assert "CUDA initialization failure" in reasons["dla_cores"]


def test_probe_tensorrt_stub_namespace_package_is_not_tensorrt() -> None:
    """Here `import tensorrt` succeeds as an empty namespace package (tensorrt-stubs)."""
    values, reasons = probe_tensorrt(importlib.import_module("tensorrt"))
    assert values == {}
    assert "not installed" in reasons["tensorrt_version"]


# --------------------------------------------------------------------------- detect_platform


def test_detect_platform_on_this_machine_never_raises(tmp_path: Path) -> None:
    p = detect_platform(tmp_path)
    assert not p.is_jetson
    assert p.l4t_release is None
    assert "not found" in p.reasons["l4t_release"]
    assert p.tensorrt_version is None
    assert p.dla_cores is None
    assert p.backends["tensorrt"] == BackendAvailability(False, p.reasons["tensorrt_version"])
    # ONNX Runtime is real here.
    assert p.onnxruntime_version == onnxruntime.__version__
    assert "CPUExecutionProvider" in p.ort_providers
    assert p.backends["onnxruntime"].usable
    assert p.machine


def test_detect_fake_jetson(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_mod, "_load_cudart", lambda: (fake_cudart(), ""))
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt("10.3.0", 2), ""))
    p = detect_platform(jetson_root(tmp_path))
    assert p.is_jetson
    assert (p.l4t_release, p.jetpack) == ("R36.4.0", "6.1")
    assert p.device_model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert (p.cuda_driver, p.cuda_runtime, p.gpu_name, p.compute_capability) == (
        "12.6",
        "12.6",
        "Orin",
        "8.7",
    )
    assert (p.tensorrt_version, p.dla_cores) == ("10.3.0", 2)
    assert p.backends["tensorrt"].usable
    assert p.has_gpu
    assert "l4t_release" not in p.reasons


def test_jetson_without_cuda_python_still_has_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt("8.5.2.2", 2), ""))
    p = detect_platform(
        jetson_root(tmp_path, release="# R35 (release), REVISION: 4.1, GCID: 1, BOARD: t186ref")
    )
    assert p.gpu_name is None
    assert "cuda" in p.reasons["gpu_name"]
    assert p.has_gpu  # every Jetson has an integrated GPU
    assert p.backends["tensorrt"].usable
    assert p.jetpack == "5.1.2"


def test_a_failing_probe_does_not_stop_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def exploding() -> tuple[ModuleType | None, str]:
        raise RuntimeError("libcudart.so: cannot open shared object file")

    broken = SimpleNamespace(cudaError_t=FakeCudaError)  # cudart missing every function
    monkeypatch.setattr(platform_mod, "_load_cudart", lambda: (broken, ""))
    monkeypatch.setattr(platform_mod, "_load_tensorrt", exploding)
    p = detect_platform(jetson_root(tmp_path))
    assert p.cuda_driver is None
    assert "cuda probe failed: AttributeError" in p.reasons["cuda_driver"]
    assert p.tensorrt_version is None
    assert "libcudart.so" in p.reasons["tensorrt_version"]
    assert p.l4t_release == "R36.4.0"
    assert p.onnxruntime_version == onnxruntime.__version__


def test_unparsable_release_file(tmp_path: Path) -> None:
    p = detect_platform(jetson_root(tmp_path, release="something else"))
    assert p.is_jetson  # the file exists
    assert p.l4t_release is None
    assert "does not parse" in p.reasons["l4t_release"]


def test_device_tree_alone_marks_jetson(tmp_path: Path) -> None:
    root = jetson_root(tmp_path)
    (root / "etc/nv_tegra_release").unlink()
    p = detect_platform(root)
    assert p.is_jetson
    assert p.device_model == "NVIDIA Jetson AGX Orin Developer Kit"


def test_trt_without_gpu_is_not_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        platform_mod, "_load_cudart", lambda: (fake_cudart(error=FakeCudaError.cudaErrorNoDevice), "")
    )
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt("10.3.0", 0), ""))
    p = detect_platform(tmp_path)
    assert not p.backends["tensorrt"].usable
    assert "no CUDA GPU" in p.backends["tensorrt"].reason


# --------------------------------------------------------------------------- summary


def test_platform_summary_is_flat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_mod, "_load_cudart", lambda: (fake_cudart(), ""))
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt("10.3.0", 2), ""))
    summary = platform_summary(detect_platform(jetson_root(tmp_path)))
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in summary.values())
    assert summary["jetpack"] == "6.1"
    assert summary["dla_cores"] == 2
    assert summary["backend_tensorrt"] is True
    assert summary["backend_onnxruntime"] is True
    assert "CPUExecutionProvider" in str(summary["ort_providers"])


def test_platform_summary_explains_missing_fields() -> None:
    p = Platform(
        reasons={"gpu_name": "no CUDA driver"}, backends={"tensorrt": BackendAvailability(False, "absent")}
    )
    summary = platform_summary(p)
    assert summary["gpu_name"] is None
    assert summary["gpu_name_reason"] == "no CUDA driver"
    assert summary["backend_tensorrt"] is False
    assert summary["backend_tensorrt_reason"] == "absent"


# --------------------------------------------------------------------------- Orin JP5/6 and Thor JP7


def test_thor_on_jetpack7_has_no_dla_and_a_newer_tensorrt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fakes for absent hardware: Thor's files, cuda-python and TensorRT 10.13 (JetPack 7.0)."""
    from agent.engines.building.plan import PlatformFacts, plan_build
    from agent.specs.build import BuildSpec

    monkeypatch.setattr(platform_mod, "_load_cudart", lambda: (fake_cudart(driver=13000, runtime=13000), ""))
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt("10.13.3", 0), ""))
    root = jetson_root(
        tmp_path, THOR_RELEASE, model=b"NVIDIA Jetson AGX Thor Developer Kit\x00", compatible=THOR_COMPATIBLE
    )
    p = detect_platform(root)
    assert (p.l4t_release, p.jetpack, p.soc, p.soc_family) == ("R38.2.0", "7.0", "tegra264", "Thor")
    assert p.soc_has_dla is False
    assert (p.tensorrt_version, p.dla_cores, p.cuda_runtime) == ("10.13.3", 0, "13.0")
    summary = platform_summary(p)  # what edge-agent info and up/info show
    assert (summary["soc"], summary["soc_family"], summary["dla_cores"]) == ("tegra264", "Thor", 0)
    facts = PlatformFacts.from_platform(p)
    assert facts.no_dla == "Jetson Thor (tegra264) has no DLA"
    plan = plan_build(BuildSpec(device="auto"), facts, model_static=True)
    assert (plan.backend, plan.device) == ("tensorrt", "gpu")
    assert "Thor (tegra264) has no DLA" in plan.changes[0].reason


@pytest.mark.parametrize(
    ("release", "trt", "jetpack"),
    [
        ("# R35 (release), REVISION: 4.1, GCID: 1, BOARD: t186ref", "8.5.2.2", "5.1.2"),
        (AGX_RELEASE, "10.3.0", "6.1"),
    ],
    ids=["orin-jetpack5", "orin-jetpack6"],
)
def test_orin_on_jetpack5_and_6_plans_the_dla(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str, trt: str, jetpack: str
) -> None:
    """Fakes for absent hardware: an AGX Orin's files and TensorRT with two DLA cores."""
    from agent.engines.building.plan import PlatformFacts, plan_build
    from agent.engines.placement.devices import placement_candidates
    from agent.specs.build import BuildSpec

    monkeypatch.setattr(platform_mod, "_load_cudart", lambda: (fake_cudart(), ""))
    monkeypatch.setattr(platform_mod, "_load_tensorrt", lambda: (fake_tensorrt(trt, 2), ""))
    p = detect_platform(jetson_root(tmp_path, release))
    assert (p.jetpack, p.soc, p.soc_family, p.soc_has_dla, p.dla_cores) == (
        jetpack,
        "tegra234",
        "Orin",
        True,
        2,
    )
    facts = PlatformFacts.from_platform(p)
    assert facts.no_dla is None
    assert plan_build(BuildSpec(device="auto"), facts, model_static=True).device == "dla"
    assert placement_candidates(BuildSpec(device="auto"), facts, model_static=True) == ("gpu", "dla0", "dla1")


def test_a_machine_without_a_device_tree_has_no_soc(tmp_path: Path) -> None:
    p = detect_platform(tmp_path)
    assert p.soc is None
    assert p.soc_has_dla is None
    assert "soc" in p.reasons
