"""``edge-agent selftest`` run for real, as an operator types it: here (no GPU, no TensorRT, no DLA) the
CPU subset passes, everything else is skipped with its reason, and both reports say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.machine.platform import detect_platform
from agent.selftest.run import CPU_STAND_INS
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[2]


def edge_agent(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=patient(240),
        check=False,
    )


@pytest.mark.slow
def test_quick_selftest_runs_the_cpu_subset_and_skips_the_rest_with_reasons(tmp_path: Path) -> None:
    platform = detect_platform()
    assert not platform.backends["tensorrt"].usable, "this test describes a machine without TensorRT"
    out = tmp_path / "reports" / "report.json"
    run = edge_agent("selftest", "--quick", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr

    document = json.loads(out.read_text())
    steps = {s["name"]: s for s in document["steps"]}
    assert document["ok"] is True
    assert document["quick"] is True
    for name in (
        "platform",
        *(f"{kind}.cpu.{p}" for kind in ("build", "cache", "throughput") for p in ("fp16", "int8")),
        "compare.backends",
        "multi_engine.slot",
        "hotswap.synthetic_stream",
    ):
        assert steps[name]["status"] == "pass", steps[name]
    for device in ("gpu", "dla0", "dla1"):
        for kind in ("build", "cache", "throughput"):
            assert steps[f"{kind}.{device}.int8"]["status"] == "skip"
    assert "tensorrt" in steps["build.gpu.fp16"]["detail"].lower()
    assert steps["fleet.downloaded_engine"]["status"] == "skip"  # a TensorRT engine only: not here
    assert "tensorrt" in steps["fleet.downloaded_engine"]["detail"].lower()
    assert steps["build.dla1.fp16"]["detail"].startswith("DLA needs TensorRT: ")
    # One slot on several engines: CPU sessions stand in for the devices here; each served frames.
    multi = steps["multi_engine.slot"]
    assert f"on {CPU_STAND_INS} engines" in multi["detail"]
    assert "0 lost" in multi["detail"]
    assert len(multi["data"]["engines"]) == CPU_STAND_INS
    assert all(engine["frames"] > 0 for engine in multi["data"]["engines"])
    assert steps["telemetry.sysfs"]["detail"].startswith("not a Jetson")
    assert "cuda-python not installed" in steps["cuda.leak_check"]["detail"]
    assert all(s["detail"] for s in document["steps"]), "every line has a detail or a reason"
    assert document["summary"]["fail"] == 0
    assert document["summary"]["pass"] + document["summary"]["skip"] == len(steps)

    # What each engine step measured, from the real build.
    assert steps["build.cpu.int8"]["data"]["calibration_cache"].endswith("calibration.trt.cache")
    assert steps["cache.cpu.int8"]["detail"].startswith("cache hit in ")
    assert steps["throughput.cpu.fp16"]["data"]["throughput_per_s"] > 0
    assert "0 lost" in steps["hotswap.synthetic_stream"]["detail"]
    assert "cpu fp16 -> int8 engine" in steps["hotswap.synthetic_stream"]["detail"]
    rows = {r["key"]: r for r in steps["compare.backends"]["data"]["rows"]}
    assert rows["ort-cpu"]["status"] == "measured"
    assert rows["tensorrt"]["status"] == "skipped"

    markdown = (out.with_suffix(".md")).read_text()
    assert markdown.startswith("# edge-agent self-test: passed")
    for name, step in steps.items():
        mark = {"pass": "PASS", "skip": "SKIP", "fail": "FAIL"}[step["status"]]
        assert f"| `{name}` | {mark} |" in markdown
    # The console shows one line per step, then the verdict.
    lines = run.stdout.splitlines()
    assert len(lines) == len(steps) + 1
    assert lines[-1].startswith("ok: ")
    assert "0 failed" in lines[-1]


def test_an_out_file_that_is_not_json_is_one_error_line(tmp_path: Path) -> None:
    run = edge_agent("selftest", "--out", "report.txt", cwd=tmp_path)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        "error: --out report.txt: give a .json file name (the Markdown report goes beside it as .md)"
    ]
