"""Self-test steps whose checks can be shown to fail here: the hot-swap verdict, the telemetry step on a
Jetson sysfs tree, the step runner's pass/fail/skip outcomes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agent.errors import EngineError
from agent.machine.platform import Platform
from agent.protocol.messages import ModelRef, ResultMessage
from agent.selftest.device_steps import telemetry_step
from agent.selftest.runtime_steps import _judge_swap, judge_engines
from agent.selftest.step import Passed, Skipped, Step, StepFailure, run_step


def result(index: int, version: str) -> ResultMessage:
    return ResultMessage(
        stream="s",
        frame_index=index,
        captured_at=1.0,
        published_at=1.0,
        model=ModelRef(slot="selftest", model_id="shapes", version=version, sha256="0" * 64),
        latency_ms={},
        msg_id=f"m{index}",
    )


def test_a_clean_swap_passes_and_names_the_frame() -> None:
    results = [result(i, "1" if i < 7 else "2") for i in (3, 1, 0, 2, 4, 5, 6, 7, 8, 9)]
    passed = _judge_swap(results, 10, 1, "1", "2", "v1 -> v2")
    assert passed.data["switch_frame"] == 7
    assert "10 frames, 0 lost, swapped at frame 7" in passed.detail


@pytest.mark.parametrize(
    ("results", "swaps", "message"),
    [
        ([result(i, "1" if i < 5 else "2") for i in range(10) if i != 4], 1, r"1 frame\(s\) lost"),
        ([result(i, "1") for i in range(10)], 0, "the swap did not happen"),
        ([result(i, "2" if i in (3, 6) else "1") for i in range(10)], 1, "mix the two versions"),
        ([result(i, "2") for i in range(10)], 1, "mix the two versions"),  # swapped before any frame
    ],
)
def test_a_lost_frame_no_swap_or_mixed_versions_fail(
    results: list[ResultMessage], swaps: int, message: str
) -> None:
    with pytest.raises(StepFailure, match=message):
        _judge_swap(results, 10, swaps, "1", "2", "v1 -> v2")


class _Run:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform


def jetson_sysfs(root: Path, *, gpu_load: bool = True) -> Path:
    """A fake Orin sysfs tree: no Jetson is here, so the files it would have are written by hand."""
    zone = root / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("gpu-thermal\n")
    (zone / "temp").write_text("41500\n")
    freq = root / "sys/class/devfreq/17000000.gpu"
    freq.mkdir(parents=True)
    (freq / "cur_freq").write_text("918000000\n")
    if gpu_load:
        load = root / "sys/devices/platform/gpu.0"
        load.mkdir(parents=True)
        (load / "load").write_text("125\n")
    return root


def test_telemetry_on_a_jetson_tree_reads_temperatures_gpu_load_and_clock(tmp_path: Path) -> None:
    run = _Run(Platform(is_jetson=True))
    passed = telemetry_step(run, jetson_sysfs(tmp_path))  # type: ignore[arg-type]
    assert "1 temperatures (temp.gpu_thermal_c 41.5)" in passed.detail
    assert "GPU load 12.5 %, GPU 918 MHz" in passed.detail


def test_telemetry_on_a_jetson_without_gpu_load_fails_naming_the_field(tmp_path: Path) -> None:
    run = _Run(Platform(is_jetson=True))
    with pytest.raises(StepFailure, match=r"not found in sysfs: gpu\.load_percent"):
        telemetry_step(run, jetson_sysfs(tmp_path, gpu_load=False))  # type: ignore[arg-type]


def test_telemetry_off_a_jetson_is_a_skip_with_the_reason(tmp_path: Path) -> None:
    run = _Run(Platform(reasons={"l4t_release": "/etc/nv_tegra_release not found"}))
    with pytest.raises(Skipped, match=r"not a Jetson \(/etc/nv_tegra_release not found\)"):
        telemetry_step(run, tmp_path)  # type: ignore[arg-type]


def test_run_step_turns_skips_failures_and_crashes_into_lines() -> None:
    def skip(_: None) -> Passed:
        raise Skipped("no DLA here")

    def engine_error(_: None) -> Passed:
        raise EngineError("cudaMalloc failed")

    def crash(_: None) -> Passed:
        raise KeyError("x")

    outcomes = [
        run_step(Step(name, 1.0, "p", fn), None)
        for name, fn in (("a", skip), ("b", engine_error), ("c", crash))
    ]
    assert [(r.status, r.detail) for r in outcomes] == [
        ("skip", "no DLA here"),
        ("fail", "cudaMalloc failed"),
        ("fail", "KeyError: 'x'"),
    ]
    ok = run_step(Step("d", 0.0, "p", lambda _: Passed("fine", {"n": 1})), None)
    assert (ok.status, ok.data, ok.over_budget) == ("pass", {"n": 1}, True)


def _rows(*frames: int) -> list[dict[str, Any]]:
    total = sum(frames)
    return [
        {"index": i, "device": d, "frames": n, "share": n / total}
        for i, (d, n) in enumerate(zip(("dla0", "dla1", "gpu"), frames, strict=False))
    ]


def test_judge_engines_passes_every_frame_in_order_with_every_engine_serving() -> None:
    passed = judge_engines(list(range(10)), 10, _rows(3, 3, 4), "dla0 + dla1 + gpu")
    assert "on 3 engines: dla0 30%, dla1 30%, gpu 40%" in passed.detail


@pytest.mark.parametrize(
    ("indices", "rows", "why"),
    [
        ([0, 1, 2, 4, 5, 6, 7, 8, 9], _rows(3, 3, 3), "1 frame(s) lost"),
        ([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], _rows(3, 3, 4), "out of frame order"),
        (list(range(10)), _rows(5, 0, 5), "engine(s) 1 (dla1) served no frame"),
    ],
)
def test_judge_engines_fails(indices: list[int], rows: list[dict[str, Any]], why: str) -> None:
    with pytest.raises(StepFailure, match=re.escape(why)):
        judge_engines(indices, 10, rows, "set")
