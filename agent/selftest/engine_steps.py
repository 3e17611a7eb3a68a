"""The engine steps: a build per device and precision, the cache hit that must follow, throughput,
and the backend comparison of ``edge-agent build --bench``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent.engines.building.artifact import EngineArtifact
from agent.measure.throughput import bench, bench_candidates, compare_backends
from agent.selftest.run import SelfTestRun
from agent.selftest.step import Passed, Skipped, Step, StepFailure
from agent.selftest.targets import (
    BUDGET_S,
    BUILD_BUDGET_S,
    Device,
    EnginePrecision,
)
from agent.specs.build import BuildSpec, CalibrationSource


def build_spec_for(run: SelfTestRun, device: Device, precision: EnginePrecision) -> BuildSpec:
    calibration = None
    if precision == "int8":
        calibration = CalibrationSource(
            kind="dataset", path=run.calibration_dir(), frames=run.sizes.calibration_frames
        )
    return BuildSpec(precision=precision, device=device, calibration=calibration)


def _placement(artifact: EngineArtifact) -> str:
    placement = artifact.effective.get("placement")
    if isinstance(placement, dict) and "dla_layers" in placement:
        return f"{placement.get('dla_layers', 0)} layers on DLA, {placement.get('gpu_layers', 0)} on GPU"
    if isinstance(placement, dict):
        return "providers " + ", ".join(str(p) for p in placement.get("providers", []))
    return "placement not reported"


def _check_placement(device: Device, artifact: EngineArtifact) -> None:
    """The engine runs where it was asked to: the plan kept the device, a DLA engine has DLA layers."""
    plan = artifact.plan
    wanted = "dla" if device.startswith("dla") else device
    if plan.device != wanted or (wanted == "dla" and plan.dla_core != int(device[3:])):
        why = "; ".join(c.reason for c in plan.changes if c.field == "device") or "no reason recorded"
        raise StepFailure(f"planned on {plan.device} (core {plan.dla_core}) instead of {device}: {why}")
    placement = artifact.effective.get("placement")
    if wanted == "dla" and isinstance(placement, dict) and not placement.get("dla_layers"):
        raise StepFailure(
            f"every layer fell back to the GPU ({_placement(artifact)}): this engine does not use the DLA"
        )


def _calibration_cache(run: SelfTestRun, artifact: EngineArtifact) -> Path | None:
    """The INT8 calibration cache this build made: ORT's TensorRT-format copy, or TensorRT's own."""
    calibration = artifact.effective.get("calibration")
    if isinstance(calibration, dict) and calibration.get("trt_cache"):
        path = Path(str(calibration["trt_cache"]))
        return path if path.is_file() else None
    made = sorted((run.builder.state_dir / "calibration").glob("*.cache"), key=lambda p: p.stat().st_mtime)
    return made[-1] if made else None


def _precision_note(artifact: EngineArtifact, precision: EnginePrecision) -> str:
    if artifact.plan.precision == precision:
        return precision
    why = "; ".join(c.reason for c in artifact.plan.changes if c.field == "precision")
    return f"{artifact.plan.precision} (asked {precision}: {why})"


def build_step(device: Device, precision: EnginePrecision) -> Step[SelfTestRun]:
    """Build the shapes model for ``device`` at ``precision`` (INT8: calibrated on the spot)."""

    def run_it(run: SelfTestRun) -> Passed:
        target = next(t for t in run.targets if t.device == device)
        if not target.usable:
            run.missing[(device, precision)] = "skipped"
            raise Skipped(target.reason)
        run.missing[(device, precision)] = "failed"
        started = time.monotonic()
        artifact = run.builder.build(run.model, build_spec_for(run, device, precision))
        seconds = time.monotonic() - started
        if artifact.cache_hit:
            raise StepFailure("the first build of a fresh cache was a cache hit: the cache is not fresh")
        _check_placement(device, artifact)
        data: dict[str, Any] = {
            "key": artifact.key,
            "backend": artifact.backend,
            "effective": artifact.effective,
            "seconds": seconds,
        }
        detail = (
            f"{artifact.backend}, {_precision_note(artifact, precision)}, built in {seconds:.1f} s; "
            f"{_placement(artifact)}"
        )
        if artifact.plan.precision == "int8":
            cache = _calibration_cache(run, artifact)
            if cache is None:
                raise StepFailure("INT8 build made no calibration cache", data)
            data["calibration_cache"] = str(cache)
            detail += f"; calibration cache {cache.name} ({cache.stat().st_size} bytes)"
        run.engines[(device, precision)] = artifact
        del run.missing[(device, precision)]
        return Passed(detail, data)

    return Step(
        f"build.{device}.{precision}",
        BUILD_BUDGET_S[(device, precision)],
        f"an engine of the bundled model builds for {device} at {precision} and runs where it was asked",
        run_it,
    )


def built_engine(run: SelfTestRun, device: Device, precision: EnginePrecision) -> EngineArtifact:
    artifact = run.engines.get((device, precision))
    if artifact is None:
        target = next(t for t in run.targets if t.device == device)
        why = target.reason if not target.usable else f"build.{device}.{precision} failed"
        raise Skipped(why)
    return artifact


def cache_step(device: Device, precision: EnginePrecision) -> Step[SelfTestRun]:
    """Build the same engine again: it must come from the cache, with the same key."""

    def run_it(run: SelfTestRun) -> Passed:
        first = built_engine(run, device, precision)
        started = time.monotonic()
        again = run.builder.build(run.model, build_spec_for(run, device, precision))
        seconds = time.monotonic() - started
        if not again.cache_hit or again.key != first.key:
            raise StepFailure(f"second build was not a cache hit (key {again.key[:12]} vs {first.key[:12]})")
        return Passed(f"cache hit in {seconds:.2f} s, key {again.key[:12]}", {"seconds": seconds})

    return Step(
        f"cache.{device}.{precision}",
        BUDGET_S["cache"],
        "a second build of the same model and spec is a cache hit (no rebuild after a restart)",
        run_it,
    )


def throughput_step(device: Device, precision: EnginePrecision) -> Step[SelfTestRun]:
    """Load the engine and time it on random input (batch 1)."""

    def run_it(run: SelfTestRun) -> Passed:
        artifact = built_engine(run, device, precision)
        result = bench(artifact, run.sizes.bench_iterations, 1)
        detail = (
            f"{result['throughput_per_s']:.1f} inferences/s, p50 {result['latency_ms_p50']:.2f} ms, "
            f"p99 {result['latency_ms_p99']:.2f} ms ({result['iterations']} runs, batch 1)"
        )
        return Passed(detail, result)

    return Step(
        f"throughput.{device}.{precision}",
        BUDGET_S["throughput"],
        "the engine loads and runs; its throughput and latency on this device",
        run_it,
    )


def compare_step(run: SelfTestRun) -> Passed:
    """``edge-agent build --bench``'s comparison: every backend here on the same model and input."""

    def native() -> EngineArtifact:
        built = run.engines.get(("gpu", "fp16"))
        return built or run.builder.build(run.model, BuildSpec(precision="fp16", device="gpu"))

    rows = compare_backends(
        run.model, bench_candidates(run.platform), iterations=run.sizes.bench_iterations, native=native
    )
    data = {"rows": [row.as_dict() for row in rows]}
    parts = []
    for row in rows:
        if row.status == "measured" and row.result is not None:
            parts.append(f"{row.key} {row.result['throughput_per_s']:.0f}/s")
        else:
            parts.append(f"{row.key} {row.status}")
    failed = [row for row in rows if row.status == "failed"]
    if failed:
        raise StepFailure("; ".join(f"{row.key}: {row.reason}" for row in failed), data)
    if not any(row.status == "measured" for row in rows):
        raise Skipped("no backend usable here: " + "; ".join(f"{r.key}: {r.reason}" for r in rows))
    return Passed(", ".join(parts), data)
