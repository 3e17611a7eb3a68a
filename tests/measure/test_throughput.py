"""Which backends ``build --bench`` compares (pure), and the comparison run for real on ONNX Runtime CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.demo.modelzoo import write_classifier
from agent.machine.platform import BackendAvailability, Platform, detect_platform
from agent.measure.throughput import bench_candidates, compare_backends

ALL_ORT = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def platform(providers: tuple[str, ...], trt: bool) -> Platform:
    return Platform(
        ort_providers=providers,
        backends={
            "onnxruntime": BackendAvailability(True, "ONNX Runtime 1.20"),
            "tensorrt": BackendAvailability(trt, "TensorRT 10.3.0" if trt else "tensorrt is not installed"),
        },
    )


@pytest.mark.parametrize(
    ("providers", "trt", "usable"),
    [
        (("CPUExecutionProvider",), False, ["ort-cpu"]),
        (("CUDAExecutionProvider", "CPUExecutionProvider"), False, ["ort-cpu", "ort-cuda"]),
        (ALL_ORT, True, ["ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt"]),
        (("CPUExecutionProvider",), True, ["ort-cpu", "tensorrt"]),  # a Jetson with the CPU-only ORT wheel
    ],
)
def test_candidates_are_every_backend_present(
    providers: tuple[str, ...], trt: bool, usable: list[str]
) -> None:
    candidates = bench_candidates(platform(providers, trt))
    assert [c.key for c in candidates] == ["ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt"]
    assert [c.key for c in candidates if c.usable] == usable
    for c in candidates:
        assert c.reason
    absent = {c.key: c.reason for c in bench_candidates(platform(("CPUExecutionProvider",), False))}
    assert (
        absent["ort-cuda"]
        == "this ONNX Runtime build has no CUDAExecutionProvider (providers: CPUExecutionProvider)"
    )
    assert absent["tensorrt"] == "tensorrt is not installed"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


def test_compare_measures_what_is_here_and_skips_the_rest(model: Path) -> None:
    rows = compare_backends(model, bench_candidates(detect_platform()), iterations=5, batch=2)
    by_key = {row.key: row for row in rows}
    assert by_key["ort-cpu"].status == "measured"
    result = by_key["ort-cpu"].result
    assert result is not None
    assert result["batch"] == 2
    assert result["throughput_per_s"] > 0
    assert by_key["tensorrt"].status == "skipped"


def test_a_provider_that_does_not_come_up_is_a_failed_row_not_a_cpu_figure(model: Path) -> None:
    # Claim CUDA is present on a machine whose ONNX Runtime lacks it: ORT quietly runs on the CPU
    # instead, and that must not be reported as a CUDA figure.
    here = detect_platform()
    assert "CUDAExecutionProvider" not in here.ort_providers, "needs a machine without CUDA"
    claimed = platform((*here.ort_providers, "CUDAExecutionProvider"), False)
    rows = {row.key: row for row in compare_backends(model, bench_candidates(claimed), iterations=3)}
    assert rows["ort-cuda"].status == "failed"
    assert "came up on CPUExecutionProvider, not CUDAExecutionProvider" in rows["ort-cuda"].reason
    assert rows["ort-cpu"].status == "measured"
