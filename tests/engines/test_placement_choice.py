"""choose_placement: which timed candidate engine(s) ``device: auto`` keeps. Table-driven, pure."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agent.engines.placement_choice import CandidateTiming, Prefer, choose_placement


def t(device: str, fps: float, dla: int | None = None, gpu: int | None = None) -> CandidateTiming:
    return CandidateTiming(
        device=device, fps=fps, p50_ms=1000.0 / fps, frames=100, dla_layers=dla, gpu_layers=gpu
    )


@dataclass(frozen=True)
class Case:
    id: str
    timings: list[CandidateTiming]
    prefer: Prefer
    chosen: tuple[str, ...]
    reason: str
    max_engines: int = 1
    limit: float = 2.0


# Figures shaped after the issue: a DLA engine can be slower than the GPU one (30 ms vs 13 ms).
CASES = [
    Case("throughput-gpu-wins", [t("gpu", 77), t("dla0", 33, 40, 2)], "throughput", ("gpu",), "fastest: gpu"),
    Case(
        "throughput-dla-wins", [t("gpu", 50), t("dla0", 60, 40, 0)], "throughput", ("dla0",), "fastest: dla0"
    ),
    Case(
        "efficiency-dla-within-factor",
        [t("gpu", 77), t("dla0", 45, 40, 2), t("dla1", 44, 40, 2)],
        "efficiency",
        ("dla0",),
        "1.71x below the GPU",
    ),
    Case(
        "efficiency-dla-too-slow",
        [t("gpu", 77), t("dla0", 33, 40, 2)],
        "efficiency",
        ("gpu",),
        "2.33x slower than the GPU",
    ),
    Case(
        "efficiency-factor-is-configurable",
        [t("gpu", 77), t("dla0", 33, 40, 2)],
        "efficiency",
        ("dla0",),
        "limit 3x",
        limit=3.0,
    ),
    Case(
        "efficiency-all-layers-on-gpu-is-not-dla",
        [t("gpu", 77), t("dla0", 76, 0, 40)],
        "efficiency",
        ("gpu",),
        "no engine runs on a DLA",
    ),
    Case(
        "efficiency-two-dlas-kept-together",
        [t("gpu", 77), t("dla0", 45, 40, 2), t("dla1", 44, 40, 2)],
        "efficiency",
        ("dla0", "dla1"),
        "prefer efficiency",
        max_engines=3,
    ),
    Case(
        "throughput-combination-of-every-accelerator",
        [t("gpu", 77), t("dla0", 45, 40, 2), t("dla1", 44, 40, 2)],
        "throughput",
        ("gpu", "dla0", "dla1"),
        "166.0 fps together",
        max_engines=3,
    ),
    Case(
        "combination-never-counts-a-gpu-fallen-dla-twice",
        [t("gpu", 77), t("dla0", 70, 0, 40), t("dla1", 44, 40, 2)],
        "throughput",
        ("gpu", "dla1"),
        "gpu + dla1",
        max_engines=3,
    ),
    Case("single-candidate", [t("gpu", 10)], "efficiency", ("gpu",), "no engine runs on a DLA"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_choose_placement(case: Case) -> None:
    choice = choose_placement(
        case.timings, case.prefer, dla_max_slowdown=case.limit, max_engines=case.max_engines
    )
    assert choice.devices == case.chosen
    assert case.reason in choice.reason


def test_a_dla_engine_that_fell_back_entirely_is_reported_as_gpu() -> None:
    fallen = t("dla0", 70, dla=0, gpu=40)
    assert fallen.all_on_gpu
    assert fallen.effective_device == "gpu"
    assert not fallen.on_dla
    report = fallen.as_dict()
    assert report["effective_device"] == "gpu"
    assert "counted as GPU" in report["note"]
    assert t("dla0", 70, dla=3, gpu=40).effective_device == "dla0"


def test_no_candidate_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_placement([], "throughput", dla_max_slowdown=2.0)
