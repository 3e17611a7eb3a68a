"""Placement by measurement: which timed engine *combination* a ``device: auto`` slot keeps. Pure.

``device: auto`` builds one engine per candidate device
(:func:`~agent.engines.placement.devices.placement_candidates`), times each alone on live frames
(:func:`~agent.engines.placement.timing.time_runner`), then times the combinations
:func:`combinations_to_try` names *together* (:func:`~agent.engines.placement.timing.time_together`: one
worker per engine pulling from one shared frame queue, as the multi-engine slot runs them) and
hands every figure here. The options are each engine alone and each combination timed together; their
frames/s are what was measured, never a sum: engines running together compete for the same silicon
(the GPU fallback layers of a DLA engine run on the GPU, every engine shares the memory bus), so the
sum of solo figures overstates a combination.

- ``prefer: throughput`` keeps the option with the highest frames/s; a tie goes to fewer engines
  (the same speed for less hardware and memory), then to the earlier option (the faster solo first);
- ``prefer: efficiency`` keeps the fastest all-DLA option (a DLA draws a fraction of the GPU's
  power; the DLA pair when that is faster than one core) unless its frames/s is more than
  ``dla_max_slowdown`` times below the fastest option, which is then kept as for throughput.

Which combinations are timed (:func:`combinations_to_try`, kept small: each costs a timing run):
every distinct accelerator together, the two fastest engines together (when there are three or more),
and the DLA set (every engine that runs on a DLA, when there are two). On an AGX Orin with
``gpu`` fastest: ``gpu+dla0+dla1``, ``gpu+dla0``, ``dla0+dla1``.

A DLA engine whose layers all fell back to the GPU runs on the GPU: it is reported as such
(``effective_device`` ``gpu``) and never counted as DLA, neither for the efficiency preference nor as
a separate accelerator in a combination (only the faster of it and the GPU engine is an option).
Why: NVIDIA measures a DLA engine slower than the GPU one for some models (30 ms vs 13 ms on Orin NX
in a user report), and DLA's GPU fallback is silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Prefer = Literal["throughput", "efficiency"]


@dataclass(frozen=True)
class CandidateTiming:
    """One candidate engine, timed alone: the device it was built for, what it ran on, and the figures.

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
class CombinationTiming:
    """Engines timed together (or one engine alone): frames/s of the set and the frames each ran."""

    devices: tuple[str, ...]
    fps: float
    engine_frames: tuple[int, ...]

    @property
    def frames(self) -> int:
        return sum(self.engine_frames)

    @classmethod
    def solo(cls, timing: CandidateTiming) -> CombinationTiming:
        """One engine alone, as its solo timing measured it."""
        return cls((timing.device,), timing.fps, (timing.frames,))

    def as_dict(self) -> dict[str, Any]:
        """The figures for job status: ``engine_frames`` in ``devices`` order, summing to ``frames``."""
        return {
            "devices": list(self.devices),
            "fps": round(self.fps, 2),
            "frames": self.frames,
            "engine_frames": list(self.engine_frames),
        }


@dataclass(frozen=True)
class PlacementChoice:
    """The candidate devices kept (best solo first), their frames/s together, and why."""

    devices: tuple[str, ...]
    reason: str
    fps: float = 0.0


def ranked_accelerators(timings: list[CandidateTiming]) -> list[CandidateTiming]:
    """Fastest first, one engine per piece of hardware: a DLA engine that runs on the GPU competes
    with the GPU engine for the same hardware, so only the faster of the two counts. Engines that
    ran no frame are left out (unless none ran any)."""
    kept: list[CandidateTiming] = []
    seen: set[str] = set()
    for timing in sorted([t for t in timings if t.fps > 0] or timings, key=lambda t: (-t.fps, t.device)):
        if timing.effective_device in seen:
            continue
        seen.add(timing.effective_device)
        kept.append(timing)
    return kept


def combinations_to_try(timings: list[CandidateTiming], max_engines: int = 3) -> list[tuple[str, ...]]:
    """The engine sets worth timing together, each fastest solo first (none for one accelerator).

    Every distinct accelerator together (at most ``max_engines``), the two fastest together when
    there are more than two, and the DLA set (every engine on a DLA) when it has two engines.
    """
    ranked = ranked_accelerators(timings)[:max_engines]
    if len(ranked) < 2:
        return []
    names = tuple(t.device for t in ranked)
    wanted = [names, names[:2], tuple(t.device for t in ranked if t.on_dla)]
    out: list[tuple[str, ...]] = []
    for combo in wanted:
        if len(combo) >= 2 and combo not in out:
            out.append(combo)
    return out


def _fastest(options: list[CombinationTiming]) -> CombinationTiming:
    """Highest frames/s; a tie goes to fewer engines, then to the earlier option."""
    return min(enumerate(options), key=lambda item: (-item[1].fps, len(item[1].devices), item[0]))[1]


def _named(option: CombinationTiming) -> str:
    return " + ".join(option.devices)


def choose_placement(
    timings: list[CandidateTiming],
    prefer: Prefer,
    *,
    dla_max_slowdown: float,
    combinations: list[CombinationTiming] | None = None,
) -> PlacementChoice:
    """The devices to keep out of the solo ``timings`` (at least one) and the ``combinations`` timed
    together (engine sets of :func:`combinations_to_try`); see the module docstring for the rule."""
    if not timings:
        raise ValueError("choose_placement needs at least one timed candidate")
    ranked = ranked_accelerators(timings)
    distinct = {t.device for t in ranked}
    on_dla = {t.device for t in ranked if t.on_dla}
    # A combination naming a device that is not its own accelerator (a DLA engine that fell back to
    # the GPU, beside the GPU engine) is not an option: it would count one piece of hardware twice.
    together = [c for c in combinations or [] if len(c.devices) > 1 and set(c.devices) <= distinct]
    options = [CombinationTiming.solo(t) for t in ranked] + together
    best = _fastest(options)
    if prefer == "efficiency":
        dla_options = [o for o in options if set(o.devices) <= on_dla]
        if not dla_options:
            return PlacementChoice(
                best.devices,
                f"prefer efficiency, but no engine runs on a DLA: {_named(best)} is fastest "
                f"at {best.fps:.1f} fps",
                best.fps,
            )
        dla = _fastest(dla_options)
        slowdown = best.fps / dla.fps if dla.fps > 0 else float("inf")
        if slowdown <= dla_max_slowdown:
            return PlacementChoice(
                dla.devices,
                f"prefer efficiency: {_named(dla)} runs at {dla.fps:.1f} fps, {slowdown:.2f}x below "
                f"the fastest ({_named(best)}, {best.fps:.1f} fps; limit {dla_max_slowdown:g}x)",
                dla.fps,
            )
        return PlacementChoice(
            best.devices,
            f"prefer efficiency, but {_named(dla)} is {slowdown:.2f}x slower than {_named(best)} "
            f"({dla.fps:.1f} vs {best.fps:.1f} fps; limit {dla_max_slowdown:g}x): {_named(best)}",
            best.fps,
        )
    if len(best.devices) == 1:
        return PlacementChoice(best.devices, f"fastest: {best.devices[0]} at {best.fps:.1f} fps", best.fps)
    solo = ranked[0]
    return PlacementChoice(
        best.devices,
        f"fastest combination: {_named(best)} at {best.fps:.1f} fps timed together "
        f"(fastest alone: {solo.device} at {solo.fps:.1f} fps)",
        best.fps,
    )
