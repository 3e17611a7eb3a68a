"""The measuring runs of placement by measurement: build and time each candidate, then time sets.

:func:`measure_candidates` builds each candidate device's engine and times it alone
(:func:`~agent.engines.placement.timing.time_runner`); :func:`measure_combinations` loads the engines of each
set :func:`~agent.engines.placement.choice.combinations_to_try` names and times them together
(:func:`~agent.engines.placement.timing.time_together`). A candidate or a set that fails is dropped with its
reason (first line), never the whole measurement. The choice itself is pure
(:mod:`agent.engines.placement.choice`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy.typing as npt

from agent.backends.base import Runner, get_backend
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.placement.choice import CandidateTiming, CombinationTiming
from agent.engines.placement.timing import time_runner, time_together
from agent.errors import BuildError, EngineError
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec

Progress = Callable[[str], None]


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or ["no reason given"])[0]


def measure_candidates(
    builder: EngineBuilder,
    model: Path,
    specs: dict[str, BuildSpec],
    frames: list[npt.NDArray[Any]],
    *,
    seconds: float,
    calibration: list[npt.NDArray[Any]] | None = None,
    preprocess: PreprocessSpec | None = None,
    say: Progress | None = None,
    cancel: threading.Event | None = None,
) -> tuple[dict[str, EngineArtifact], list[CandidateTiming], dict[str, str]]:
    """Build each candidate of ``specs`` (label -> spec) and time it alone on ``frames`` for
    ``seconds``: the artifacts, the timings, and why a candidate failed."""
    tell = say or (lambda _msg: None)
    built: dict[str, EngineArtifact] = {}
    timed: list[CandidateTiming] = []
    failed: dict[str, str] = {}
    for label, candidate in specs.items():
        try:
            artifact = builder.build(
                model, candidate, calibration=calibration, preprocess=preprocess, progress=say, cancel=cancel
            )
            runner = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
            try:
                timing = time_runner(runner, frames, seconds=seconds, cancel=cancel)
            finally:
                runner.close()
        except (BuildError, EngineError) as exc:
            if cancel is not None and cancel.is_set():
                raise
            failed[label] = _first_line(exc)
            tell(f"placement: candidate {label} dropped: {failed[label]}")
            continue
        placement = artifact.effective.get("placement") or {}
        built[label] = artifact
        timed.append(
            CandidateTiming(
                device=label,
                fps=timing.fps,
                p50_ms=timing.p50_ms,
                frames=timing.frames,
                dla_layers=placement.get("dla_layers"),
                gpu_layers=placement.get("gpu_layers"),
            )
        )
        tell(f"placement: {label} {timing.fps:.1f} fps, p50 {timing.p50_ms:.2f} ms")
    return built, timed, failed


def measure_combinations(
    built: dict[str, EngineArtifact],
    combinations: list[tuple[str, ...]],
    frames: list[npt.NDArray[Any]],
    *,
    seconds: float,
    say: Progress | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[CombinationTiming], dict[str, str]]:
    """Time each set of ``combinations`` (labels of ``built``) together on ``frames`` for ``seconds``:
    the timings, and why a set failed (keyed ``"gpu+dla0"``). Each set's engines are loaded for it
    as the slot loads a set of that size (``parallel_runs``), and closed after."""
    tell = say or (lambda _msg: None)
    timed: list[CombinationTiming] = []
    failed: dict[str, str] = {}
    for devices in combinations:
        label = "+".join(devices)
        runners: list[Runner] = []
        try:
            for device in devices:
                artifact = built[device]
                options = replace(artifact.load_options(), parallel_runs=len(devices))
                runners.append(get_backend(artifact.backend).load(artifact.engine_path, options))
            timing = time_together(runners, frames, seconds=seconds, cancel=cancel)
        except (BuildError, EngineError) as exc:
            if cancel is not None and cancel.is_set():
                raise
            failed[label] = _first_line(exc)
            tell(f"placement: set {label} dropped: {failed[label]}")
            continue
        finally:
            for runner in runners:
                runner.close()
        timed.append(CombinationTiming(devices, timing.fps, timing.engine_frames))
        shares = ", ".join(str(n) for n in timing.engine_frames)
        tell(f"placement: {label} together {timing.fps:.1f} fps (frames per engine: {shares})")
    return timed, failed
