"""Placement by measurement, the pure half: which sets ``device: auto`` times together, and which it keeps.

Table-driven: solo timings (each engine alone) and combination timings (engines timed together) in,
the kept devices and the reason out. Figures are shaped after the issue: a DLA engine can be slower
than the GPU one (30 ms vs 13 ms), and engines together are slower than the sum of their solo figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agent.engines.placement.choice import (
    CandidateTiming,
    CombinationTiming,
    Prefer,
    choose_placement,
    combinations_to_try,
    ranked_accelerators,
)


def t(device: str, fps: float, dla: int | None = None, gpu: int | None = None) -> CandidateTiming:
    return CandidateTiming(
        device=device,
        fps=fps,
        p50_ms=1000.0 / fps if fps else 0.0,
        frames=100,
        dla_layers=dla,
        gpu_layers=gpu,
    )


def c(*devices: str, fps: float) -> CombinationTiming:
    """A set timed together; the frames each engine ran do not matter to the choice."""
    return CombinationTiming(tuple(devices), fps, tuple(10 for _ in devices))


GPU, DLA0, DLA1 = t("gpu", 77), t("dla0", 45, 40, 2), t("dla1", 44, 40, 2)
FALLEN_DLA0 = t("dla0", 70, 0, 40)  # every layer fell back to the GPU: it runs on the GPU


@dataclass(frozen=True)
class TryCase:
    id: str
    timings: list[CandidateTiming]
    tried: list[tuple[str, ...]]
    max_engines: int = 3


TRY_CASES = [
    TryCase(
        "orin-gpu-fastest: all, two fastest, DLA pair",
        [GPU, DLA0, DLA1],
        [("gpu", "dla0", "dla1"), ("gpu", "dla0"), ("dla0", "dla1")],
    ),
    TryCase(
        "dla-fastest: the two fastest are the DLA pair (tried once)",
        [t("gpu", 30), t("dla0", 45, 40, 0), t("dla1", 44, 40, 0)],
        [("dla0", "dla1", "gpu"), ("dla0", "dla1")],
    ),
    TryCase("gpu-and-one-dla: the pair", [GPU, DLA0], [("gpu", "dla0")]),
    TryCase("one-candidate: nothing to combine", [GPU], []),
    TryCase(
        "fallen-dla-is-the-gpu-again: never beside the GPU",
        [GPU, FALLEN_DLA0, DLA1],
        [("gpu", "dla1")],
    ),
    TryCase("fallen-dla-alone-with-gpu: one accelerator", [GPU, FALLEN_DLA0], []),
    TryCase(
        "fallen-dla-faster-than-gpu-stands-for-the-gpu",
        [t("gpu", 60), t("dla0", 70, 0, 40), DLA1],
        [("dla0", "dla1")],
    ),
    TryCase("a candidate that ran no frame is left out", [GPU, t("dla0", 0.0, 40, 2)], []),
    TryCase("max-engines-caps-the-set", [GPU, DLA0, DLA1], [("gpu", "dla0")], max_engines=2),
]


@pytest.mark.parametrize("case", TRY_CASES, ids=[c.id for c in TRY_CASES])
def test_combinations_to_try(case: TryCase) -> None:
    assert combinations_to_try(case.timings, case.max_engines) == case.tried


@dataclass(frozen=True)
class Case:
    id: str
    timings: list[CandidateTiming]
    prefer: Prefer
    chosen: tuple[str, ...]
    reason: str
    together: tuple[CombinationTiming, ...] = ()
    limit: float = 2.0
    fps: float | None = None


ORIN_SETS = (c("gpu", "dla0", "dla1", fps=150), c("gpu", "dla0", fps=115), c("dla0", "dla1", fps=86))

CASES = [
    # Solo only (prepare: one engine): the old rule still holds.
    Case("throughput-gpu-wins", [GPU, t("dla0", 33, 40, 2)], "throughput", ("gpu",), "fastest: gpu", fps=77),
    Case(
        "throughput-dla-wins", [t("gpu", 50), t("dla0", 60, 40, 0)], "throughput", ("dla0",), "fastest: dla0"
    ),
    Case(
        "efficiency-dla-within-factor",
        [GPU, DLA0, DLA1],
        "efficiency",
        ("dla0",),
        "1.71x below the fastest (gpu, 77.0 fps",
    ),
    Case(
        "efficiency-dla-too-slow",
        [GPU, t("dla0", 33, 40, 2)],
        "efficiency",
        ("gpu",),
        "2.33x slower than gpu",
    ),
    Case(
        "efficiency-factor-is-configurable",
        [GPU, t("dla0", 33, 40, 2)],
        "efficiency",
        ("dla0",),
        "limit 3x",
        limit=3.0,
    ),
    Case(
        "efficiency-all-layers-on-gpu-is-not-dla",
        [GPU, t("dla0", 76, 0, 40)],
        "efficiency",
        ("gpu",),
        "no engine runs on a DLA",
    ),
    Case("single-candidate", [t("gpu", 10)], "efficiency", ("gpu",), "no engine runs on a DLA"),
    # Sets timed together.
    Case(
        "throughput-every-accelerator-together",
        [GPU, DLA0, DLA1],
        "throughput",
        ("gpu", "dla0", "dla1"),
        "gpu + dla0 + dla1 at 150.0 fps timed together (fastest alone: gpu at 77.0 fps)",
        ORIN_SETS,
        fps=150,
    ),
    Case(
        "throughput-measured-not-summed: contention makes the pair the best",
        [GPU, DLA0, DLA1],
        "throughput",
        ("gpu", "dla0"),
        "gpu + dla0 at 120.0 fps",
        (c("gpu", "dla0", "dla1", fps=110), c("gpu", "dla0", fps=120), c("dla0", "dla1", fps=86)),
    ),
    Case(
        "throughput-a-set-slower-than-one-engine-loses",
        [GPU, DLA0],
        "throughput",
        ("gpu",),
        "fastest: gpu at 77.0 fps",
        (c("gpu", "dla0", fps=70),),
    ),
    Case(
        "tie-goes-to-fewer-engines",
        [GPU, DLA0],
        "throughput",
        ("gpu",),
        "fastest: gpu",
        (c("gpu", "dla0", fps=77),),
    ),
    Case(
        "tie-between-sets-goes-to-the-smaller-then-the-earlier",
        [GPU, DLA0, DLA1],
        "throughput",
        ("gpu", "dla0"),
        "gpu + dla0 at 120.0 fps",
        (c("gpu", "dla0", "dla1", fps=120), c("gpu", "dla0", fps=120), c("dla0", "dla1", fps=120)),
    ),
    Case(
        "tie-between-solos-goes-to-the-first-ranked",
        [t("dla0", 50, 40, 0), t("gpu", 50)],
        "throughput",
        ("dla0",),
        "fastest: dla0",
    ),
    Case(
        "efficiency-keeps-the-dla-pair-within-the-factor-of-the-best-set",
        [GPU, DLA0, DLA1],
        "efficiency",
        ("dla0", "dla1"),
        "dla0 + dla1 runs at 86.0 fps, 1.74x below the fastest (gpu + dla0 + dla1, 150.0 fps",
        ORIN_SETS,
        fps=86,
    ),
    Case(
        "efficiency-dla-pair-too-slow-against-the-best-set",
        [GPU, DLA0, DLA1],
        "efficiency",
        ("gpu", "dla0", "dla1"),
        "dla0 + dla1 is 2.31x slower than gpu + dla0 + dla1",
        (c("gpu", "dla0", "dla1", fps=150), c("dla0", "dla1", fps=65)),
        fps=150,
    ),
    Case(
        "efficiency-a-pair-slower-than-one-dla-keeps-one",
        [GPU, DLA0, DLA1],
        "efficiency",
        ("dla0",),
        "dla0 runs at 45.0 fps",
        (c("dla0", "dla1", fps=40),),
    ),
    Case(
        "fallen-dla-never-counted-as-a-second-accelerator",
        [GPU, FALLEN_DLA0, DLA1],
        "throughput",
        ("gpu", "dla1"),
        "gpu + dla1",
        # A set with the fallen DLA beside the GPU is not an option, however fast it was measured.
        (c("gpu", "dla0", "dla1", fps=500), c("gpu", "dla1", fps=110)),
    ),
    Case(
        "fallen-dla-never-counted-as-dla-in-a-set",
        [GPU, FALLEN_DLA0, DLA1],
        "efficiency",
        ("dla1",),
        "dla1 runs at 44.0 fps, 2.50x below the fastest (gpu + dla1, 110.0 fps; limit 3x)",
        (c("gpu", "dla1", fps=110),),
        limit=3.0,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_choose_placement(case: Case) -> None:
    choice = choose_placement(
        case.timings, case.prefer, dla_max_slowdown=case.limit, combinations=list(case.together)
    )
    assert choice.devices == case.chosen
    assert case.reason in choice.reason
    if case.fps is not None:
        assert choice.fps == case.fps


def test_a_dla_engine_that_fell_back_entirely_is_reported_as_gpu() -> None:
    fallen = t("dla0", 70, dla=0, gpu=40)
    assert fallen.all_on_gpu
    assert fallen.effective_device == "gpu"
    assert not fallen.on_dla
    report = fallen.as_dict()
    assert report["effective_device"] == "gpu"
    assert "counted as GPU" in report["note"]
    assert t("dla0", 70, dla=3, gpu=40).effective_device == "dla0"
    assert [r.device for r in ranked_accelerators([GPU, FALLEN_DLA0, DLA1])] == ["gpu", "dla1"]


def test_a_combination_reports_the_frames_each_engine_ran() -> None:
    together = CombinationTiming(("gpu", "dla0"), 120.456, (300, 62))
    assert together.as_dict() == {
        "devices": ["gpu", "dla0"],
        "fps": 120.46,
        "frames": 362,
        "engine_frames": [300, 62],
    }
    assert CombinationTiming.solo(GPU).as_dict() == {
        "devices": ["gpu"],
        "fps": 77,
        "frames": 100,
        "engine_frames": [100],
    }


def test_no_candidate_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_placement([], "throughput", dla_max_slowdown=2.0)
