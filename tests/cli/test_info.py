"""``edge-agent info`` as text (issue 22.11): no Python ``None``, each backend once, reasons inline."""

from __future__ import annotations

import pytest

from agent.cli import main
from agent.cli.info import info_lines


def test_info_on_this_machine_prints_no_python_none_and_each_backend_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent.machine.platform import detect_platform

    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()

    assert not [line for line in lines if "None" in line.split()]
    assert not [line for line in lines if line.split()[0].endswith("_reason")]
    for name in detect_platform().backends:
        assert sum(1 for line in lines if line.split()[:2] == ["backend", name]) == 1
    assert not [line for line in lines if line.startswith("backend_")]


def test_a_fact_that_could_not_be_read_shows_its_reason_beside_it() -> None:
    summary = {
        "is_jetson": False,
        "gpu_name": None,
        "gpu_name_reason": "cuda-python not installed",
        "jetpack": None,
        "onnxruntime_version": "1.20.0",
        "backend_tensorrt": False,
        "backend_tensorrt_reason": "tensorrt is not installed",
    }
    lines = info_lines(
        summary, {"tensorrt": (False, "tensorrt is not installed"), "onnxruntime": (True, "ok")}
    )

    assert lines == [
        "is_jetson            no",
        "gpu_name             -  (cuda-python not installed)",
        "jetpack              -  (not a Jetson)",
        "onnxruntime_version  1.20.0",
        "backend onnxruntime  usable: ok",
        "backend tensorrt     unusable: tensorrt is not installed",
    ]
