"""Placement by measurement: which timed candidate engine(s) a ``device: auto`` slot keeps. Pure.

``device: auto`` builds one engine per candidate device (:func:`~agent.engines.plan.placement_candidates`),
times each on live frames (:mod:`agent.engines.timing`) and hands the figures here:

- ``prefer: throughput`` keeps the fastest engine, or with room for several engines
  (``max_engines`` > 1) every engine on its own accelerator, fastest first;
- ``prefer: efficiency`` keeps the DLA (it draws a fraction of the GPU's power) unless its
  throughput is more than ``dla_max_slowdown`` times below the GPU's; several DLA cores are kept
  together when there is room.

A DLA engine whose layers all fell back to the GPU runs on the GPU: it is reported as such
(``effective_device`` ``gpu``) and never counted as DLA, neither for the efficiency preference nor as
a separate accelerator in a combination. Why: NVIDIA measures a DLA engine slower than the GPU one
for some models (30 ms vs 13 ms on Orin NX in a user report), and DLA's GPU fallback is silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Prefer = Literal["throughput", "efficiency"]


@dataclass(frozen=True)
class CandidateTiming:
    """One candidate engine, timed: the device it was built for, what it ran on, and the figures.

    ``dla_layers``/``gpu_layers``: the engine's layer placement (None when the backend reports none).
    """

    device: str
    fps: float
    p50_ms: float
    frames: int
    dla_layers: int | None = None
    gpu_layers: int | None = None

    @property
    def all_on_gpu(self) -> bool:
        """A DLA engine with no layer on the DLA: every layer fell back to the GPU."""
        return self.device.startswith("dla") and self.dla_layers == 0 and (self.gpu_layers or 0) > 0

    @property
    def effective_device(self) -> str:
        """Where it really runs: ``gpu`` for a DLA engine that fell back entirely, else its device."""
        return "gpu" if self.all_on_gpu else self.device

    @property
    def on_dla(self) -> bool:
        return self.effective_device.startswith("dla")

    def as_dict(self) -> dict[str, Any]:
        """The figures for job status."""
        out: dict[str, Any] = {
            "device": self.device,
            "effective_device": self.effective_device,
            "fps": round(self.fps, 2),
            "p50_ms": round(self.p50_ms, 3),
            "frames": self.frames,
        }
        if self.dla_layers is not None:
            out["dla_layers"] = self.dla_layers
            out["gpu_layers"] = self.gpu_layers
        if self.all_on_gpu:
            out["note"] = "every layer fell back to the GPU: counted as GPU, not DLA"
        return out


@dataclass(frozen=True)
class PlacementChoice:
    """The candidate devices kept (best first) and why."""

    devices: tuple[str, ...]
    reason: str


def _distinct_accelerators(timings: list[CandidateTiming]) -> list[CandidateTiming]:
    """Fastest first, one engine per piece of hardware: a DLA engine that runs on the GPU competes
    with the GPU engine for the same hardware, so only the faster of the two counts."""
    kept: list[CandidateTiming] = []
    seen: set[str] = set()
    for timing in sorted(timings, key=lambda t: (-t.fps, t.device)):
        if timing.effective_device in seen:
            continue
        seen.add(timing.effective_device)
        kept.append(timing)
    return kept


def choose_placement(
    timings: list[CandidateTiming],
    prefer: Prefer,
    *,
    dla_max_slowdown: float,
    max_engines: int = 1,
) -> PlacementChoice:
    """The devices to keep out of the timed ``timings`` (at least one timing; best first)."""
    if not timings:
        raise ValueError("choose_placement needs at least one timed candidate")
    if max_engines < 1:
        raise ValueError(f"max_engines must be >= 1, not {max_engines}")
    ranked = _distinct_accelerators([t for t in timings if t.fps > 0] or timings)
    fastest = ranked[0]
    if prefer == "efficiency":
        dlas = [t for t in ranked if t.on_dla]
        gpu = next((t for t in ranked if t.effective_device == "gpu"), None)
        if dlas:
            best_dla = dlas[0]
            reference = gpu.fps if gpu is not None else best_dla.fps
            slowdown = reference / best_dla.fps if best_dla.fps > 0 else float("inf")
            if slowdown <= dla_max_slowdown:
                kept = tuple(t.device for t in dlas[:max_engines])
                return PlacementChoice(
                    kept,
                    f"prefer efficiency: {best_dla.device} runs at {best_dla.fps:.1f} fps, "
                    f"{slowdown:.2f}x below the GPU (limit {dla_max_slowdown:g}x)",
                )
            assert gpu is not None  # slowdown > limit >= 1 needs a faster GPU engine
            return PlacementChoice(
                (gpu.device,),
                f"prefer efficiency, but {best_dla.device} is {slowdown:.2f}x slower than the GPU "
                f"({best_dla.fps:.1f} vs {gpu.fps:.1f} fps; limit {dla_max_slowdown:g}x): GPU",
            )
        return PlacementChoice(
            (fastest.device,), f"prefer efficiency, but no engine runs on a DLA: {fastest.device} is fastest"
        )
    if max_engines == 1:
        return PlacementChoice((fastest.device,), f"fastest: {fastest.device} at {fastest.fps:.1f} fps")
    kept_timings = ranked[:max_engines]
    total = sum(t.fps for t in kept_timings)
    names = " + ".join(t.device for t in kept_timings)
    return PlacementChoice(
        tuple(t.device for t in kept_timings),
        f"fastest combination: {names}, {total:.1f} fps together (sum of each engine timed alone)",
    )
