"""``edge-agent build``: run as a real subprocess (``python -m agent.cli.build``) and in process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import structlog

from agent.cli.build import add_build_arguments, run_build
from agent.demo.modelzoo import write_classifier
from agent.errors import BuildError
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[2]


def edge_agent_build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli.build", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=patient(240),
        check=False,
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


@pytest.mark.slow
def test_build_prints_plan_cache_placement_then_hits_with_bench(tmp_path: Path, model: Path) -> None:
    state = str(tmp_path / "state")
    cold = edge_agent_build(str(model), "--precision", "fp16", "--state-dir", state)
    assert cold.returncode == 0, cold.stderr
    out = cold.stdout
    assert "plan       backend onnxruntime, device cpu, precision fp32" in out
    assert "change   backend: auto -> onnxruntime" in out
    assert "change   precision: fp16 -> fp32" in out
    assert "cache      miss, built and stored: key " in out
    assert "placement  providers CPUExecutionProvider" in out
    key = out.split("key ")[1].split()[0]
    assert (tmp_path / "state" / "engines" / key / "model.onnx").is_file()

    warm = edge_agent_build(
        str(model), "--precision", "fp16", "--state-dir", state, "--bench", "--iterations", "20"
    )
    assert warm.returncode == 0, warm.stderr
    assert f"cache      hit: key {key}" in warm.stdout
    assert "build      cache hit" in warm.stdout
    assert "inferences/s (batch 1, 20 runs)" in warm.stdout
    # Every backend side by side: this build's row measured, the absent ones skipped with the reason.
    compare = [line for line in warm.stdout.splitlines() if line.startswith("compare    ")]
    assert [line.split("  ")[2].strip() for line in compare] == [
        "ONNX Runtime CPU",
        "ONNX Runtime CUDA",
        "ONNX Runtime TensorRT EP",
        "TensorRT (native)",
    ]
    assert compare[0].endswith("(this build)")
    assert "inferences/s" in compare[0]
    assert "skipped: this ONNX Runtime build has no CUDAExecutionProvider" in compare[1]
    assert "skipped: tensorrt" in compare[3]


def test_int8_with_calibration_images_as_json(tmp_path: Path, model: Path) -> None:
    images = tmp_path / "calib"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        cv2.imwrite(str(images / f"{i}.jpg"), rng.integers(0, 255, (40, 40, 3), dtype=np.uint8))
    result = edge_agent_build(
        str(model),
        "--precision",
        "int8",
        "--device",
        "cpu",
        "--calib",
        str(images),
        "--state-dir",
        str(tmp_path / "state"),
        "--json",
        "--bench",
        "--iterations",
        "5",
        "--batch",
        "2",
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["plan"]["precision"] == "int8"
    assert document["plan"]["int8_mode"] == "qdq"
    assert document["cache_hit"] is False
    assert Path(document["effective"]["calibration"]["trt_cache"]).is_file()
    assert document["bench"]["batch"] == 2
    assert document["bench"]["throughput_per_s"] > 0
    rows = {row["key"]: row for row in document["compare"]}
    assert rows["ort-cpu"]["note"] == "this build"
    assert rows["ort-cpu"]["bench"] == document["bench"]
    assert rows["tensorrt"]["status"] == "skipped"


def test_errors_exit_1_with_a_message(tmp_path: Path, model: Path) -> None:
    missing = edge_agent_build(str(tmp_path / "nope.onnx"), "--state-dir", str(tmp_path / "s"))
    assert missing.returncode == 1
    assert "error: model" in missing.stderr
    int8 = edge_agent_build(str(model), "--precision", "int8", "--state-dir", str(tmp_path / "s"))
    assert int8.returncode == 1
    # Said in this command's flags, not in a deploy manifest's build spec.
    assert "error: --precision int8: classifier.onnx is not quantized" in int8.stderr
    assert "add --calib DIR (images to calibrate on) or --calib-cache FILE" in int8.stderr
    assert "build spec" not in int8.stderr
    garbage = tmp_path / "bad.onnx"
    garbage.write_text("not a model")
    bad = edge_agent_build(str(garbage), "--state-dir", str(tmp_path / "s"))
    assert bad.returncode == 1
    assert f"error: {garbage} is not a readable ONNX model" in bad.stderr
    assert "deploy" not in bad.stderr  # offline: there is nothing to deploy again
    assert "Traceback" not in missing.stderr + int8.stderr + bad.stderr


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """run_build reconfigures structlog for a CLI process; put this test process's config back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("restore_structlog")
def test_run_build_in_process(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    args = parser.parse_args(
        [str(model), "--device", "cpu", "--precision", "fp32", "--state-dir", str(tmp_path)]
    )
    assert run_build(args) == 0
    assert (
        "backend: auto -> onnxruntime (device cpu: TensorRT runs on GPU or DLA only)"
        in capsys.readouterr().out
    )
    assert run_build(args) == 0
    assert "cache      hit" in capsys.readouterr().out
    both = parser.parse_args([str(model), "--calib", "d", "--calib-cache", "c", "--state-dir", str(tmp_path)])
    with pytest.raises(BuildError, match="not both"):
        run_build(both)


def test_int8_calibrated_on_frames_of_a_video(tmp_path: Path, model: Path) -> None:
    from agent.demo.setup import write_demo_video

    video = write_demo_video(tmp_path / "lobby.avi", frames=40, size=(80, 60), fps=15.0)
    images = tmp_path / "calib-lobby"
    result = edge_agent_build(
        str(model),
        *(
            "--precision",
            "int8",
            "--engine-device",
            "cpu",
            "--calib-from",
            str(video),
            "--calib",
            str(images),
        ),
        *("--calib-frames", "8", "--state-dir", str(tmp_path / "state")),
    )
    assert result.returncode == 0, result.stderr
    assert f"calib      8 frames of {video} written to {images}/" in result.stdout
    assert len(list(images.glob("frame-*.jpg"))) == 8
    assert "plan       backend onnxruntime, device cpu, precision int8" in result.stdout
    assert "calib      entropy: table" in result.stdout


def test_calib_from_without_int8_is_one_error_line(tmp_path: Path, model: Path) -> None:
    # `edge-agent build` as a user types it (python -m agent.cli.build adds runpy's warning line).
    result = subprocess.run(
        [sys.executable, "-m", "agent", "build", str(model), "--calib-from", "x.avi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --calib-from makes INT8 calibration images: add --precision int8 (not fp16)"
    ]


def test_calib_from_names_its_folder_after_the_video() -> None:
    from agent.cli.build import calib_dir_for

    assert calib_dir_for("/data/lobby.avi") == Path("calib-lobby")
    assert calib_dir_for("rtsp://cam-3.local:554/live/main?ch=1") == Path("calib-main")


@pytest.mark.slow
def test_int8_reports_its_agreement_with_fp32_and_a_short_video(tmp_path: Path, model: Path) -> None:
    """Issue 22.11: an INT8 build said nothing of its agreement with FP32, nor that --calib-from gave
    fewer frames than --calib-frames asked."""
    from agent.demo.setup import write_demo_video

    video = write_demo_video(tmp_path / "short.avi", frames=12, size=(80, 60), fps=15.0)
    images = tmp_path / "calib-short"
    state = ("--state-dir", str(tmp_path / "state"))
    text = edge_agent_build(
        str(model),
        *(
            "--precision",
            "int8",
            "--engine-device",
            "cpu",
            "--calib-from",
            str(video),
            "--calib",
            str(images),
        ),
        *("--calib-frames", "20", *state),
    )
    assert text.returncode == 0, text.stderr
    written = len(list(images.glob("frame-*.jpg")))
    assert 0 < written < 20
    assert (
        f"calib      {written} of the 20 frames asked (--calib-frames): {video} gave no more" in text.stdout
    )
    assert f"agreement  INT8 vs FP32 on {written} calibration image(s): top-1 agreement " in text.stdout

    as_json = edge_agent_build(
        str(model), "--precision", "int8", "--engine-device", "cpu", "--calib", str(images),
        "--calib-frames", "20", "--json", *state,
    )  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    agreement = json.loads(as_json.stdout)["int8_agreement"]
    assert agreement["frames"] == written
    assert agreement["skipped"] is None
    assert 0.0 <= agreement["top1_agreement"] <= 1.0
    assert agreement["max_abs_diff"] >= 0.0
