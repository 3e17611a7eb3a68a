"""Which devices the self-test builds for, decided from platform facts (pure), and the step budgets."""

from __future__ import annotations

from agent.machine.platform import BackendAvailability, Platform
from agent.selftest.steps import all_steps
from agent.selftest.targets import TOTAL_BUDGET_S, device_targets, total_budget_s

ORT = BackendAvailability(True, "ONNX Runtime 1.20")
NO_TRT = BackendAvailability(False, "tensorrt is not installed")


def facts(
    trt: BackendAvailability = NO_TRT,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    dla: int | None = None,
    version: str | None = None,
) -> Platform:
    return Platform(
        tensorrt_version=version,
        dla_cores=dla,
        onnxruntime_version="1.20",
        ort_providers=providers,
        backends={"tensorrt": trt, "onnxruntime": ORT},
    )


def usable(platform: Platform) -> dict[str, str | bool]:
    return {t.device: t.usable for t in device_targets(platform)}


def test_a_pc_without_tensorrt_or_a_gpu_provider_tests_the_cpu_only_and_says_why() -> None:
    targets = {t.device: t for t in device_targets(facts())}
    assert usable(facts()) == {"gpu": False, "dla0": False, "dla1": False, "cpu": True}
    assert "tensorrt is not installed" in targets["gpu"].reason
    assert "ONNX Runtime has no CUDA or TensorRT provider (CPUExecutionProvider)" in targets["gpu"].reason
    assert targets["dla0"].reason == "DLA needs TensorRT: tensorrt is not installed"


def test_onnx_runtime_with_cuda_makes_the_gpu_usable_without_tensorrt() -> None:
    platform = facts(providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert usable(platform) == {"gpu": True, "dla0": False, "dla1": False, "cpu": True}
    assert "ONNX Runtime CUDAExecutionProvider" in device_targets(platform)[0].reason


def test_an_agx_orin_tests_gpu_both_dlas_and_cpu() -> None:
    platform = facts(BackendAvailability(True, "TensorRT 10.3.0"), dla=2, version="10.3.0")
    assert usable(platform) == {"gpu": True, "dla0": True, "dla1": True, "cpu": True}


def test_an_orin_nano_or_thor_without_dla_skips_both_cores_naming_the_count() -> None:
    platform = facts(BackendAvailability(True, "TensorRT 10.3.0"), dla=0, version="10.3.0")
    targets = {t.device: t for t in device_targets(platform)}
    assert targets["gpu"].usable
    assert not targets["dla0"].usable
    assert targets["dla1"].reason == "this device has 0 DLA cores"
    one = {
        t.device: t for t in device_targets(facts(BackendAvailability(True, "x"), dla=1, version="10.3.0"))
    }
    assert one["dla0"].usable
    assert one["dla1"].reason == "this device has 1 DLA core"


def test_every_step_has_a_budget_and_together_they_fit_ten_minutes_on_an_orin() -> None:
    steps = all_steps()
    assert sum(step.budget_s for step in steps) == total_budget_s()
    assert total_budget_s() <= TOTAL_BUDGET_S
    assert len({step.name for step in steps}) == len(steps)
    assert all(step.budget_s > 0 and step.proves for step in steps)
