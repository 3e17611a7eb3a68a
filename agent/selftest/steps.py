"""The self-test's steps, in the order they run, and the context they share.

Every step uses the agent's own code on this machine's hardware: the engine builder and its cache
(:mod:`agent.engines.builder`), the backend comparison of ``edge-agent build --bench``
(:mod:`agent.benchmark`), a model slot with a live pipeline (:mod:`agent.runtime`), the device
statistics telemetry publishes (:mod:`agent.telemetry.device`) and the CUDA wrappers TensorRT runs on
(:mod:`agent.backends.cuda`). The model is the bundled shapes classifier; INT8 calibrates on shapes
images generated on the spot, so nothing is downloaded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import cv2
import numpy as np
from pydantic import BaseModel

from agent.benchmark import bench, bench_candidates, compare_backends
from agent.camera.preprocess_spec import PreprocessSpec
from agent.camera.source import VideoSource
from agent.camera.source_spec import SyntheticSourceSpec
from agent.datasets import shapes
from agent.engines.artifact import EngineArtifact
from agent.engines.builder import EngineBuilder
from agent.engines.spec import BuildSpec, CalibrationSource
from agent.platform import Platform, platform_summary
from agent.postprocess.spec import ClassificationSpec
from agent.protocol.messages import ResultMessage
from agent.runtime.loaded import EngineReport, ModelSource
from agent.runtime.pipeline import SlotPipeline, StreamPlan
from agent.runtime.slot import ModelSlot
from agent.selftest.step import Passed, Skipped, Step, StepFailure
from agent.selftest.targets import (
    BUDGET_S,
    BUILD_BUDGET_S,
    PRECISIONS,
    Device,
    DeviceTarget,
    EnginePrecision,
    device_targets,
)
from agent.telemetry import DeviceStats, Metrics

#: The bundled model's input size (shapes.MODEL_PATH: [batch, 3, 64, 64], RGB / 255).
INPUT_SIZE = 64
#: Engines the multi-engine step runs when fewer than two devices are usable: CPU sessions stand in.
CPU_STAND_INS = 3
#: Largest drop of free device memory the leak check accepts (allocator noise, not 1 MiB per cycle).
LEAK_TOLERANCE_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Sizes:
    """How much each step does: the full run, or ``--quick``."""

    calibration_frames: int
    bench_iterations: int
    stream_frames: int
    leak_cycles: int


FULL = Sizes(calibration_frames=64, bench_iterations=300, stream_frames=300, leak_cycles=1000)
QUICK = Sizes(calibration_frames=16, bench_iterations=50, stream_frames=120, leak_cycles=200)


@dataclass
class SelfTestRun:
    """What the steps share: the platform, a builder on a scratch cache, and the engines built so far."""

    platform: Platform
    builder: EngineBuilder
    work_dir: Path
    sizes: Sizes
    model: Path = shapes.MODEL_PATH
    targets: list[DeviceTarget] = field(default_factory=list)
    engines: dict[tuple[Device, EnginePrecision], EngineArtifact] = field(default_factory=dict)
    #: Why an engine has no artifact (build failed or skipped), for the steps that need it.
    missing: dict[tuple[Device, EnginePrecision], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = device_targets(self.platform)

    def calibration_dir(self) -> Path:
        """Shapes images to calibrate INT8 on, written once (seed 7: not the training seeds)."""
        folder = self.work_dir / "calibration-images"
        if not folder.is_dir():
            images, _ = shapes.generate(self.sizes.calibration_frames, seed=7, size=INPUT_SIZE)
            tmp = folder.with_name(folder.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(images):
                cv2.imwrite(str(tmp / f"shape-{i:04d}.png"), image)
            os.replace(tmp, folder)
        return folder


# --------------------------------------------------------------------------- platform


def platform_step(run: SelfTestRun) -> Passed:
    """The facts every later step depends on, and which devices they make usable."""
    p = run.platform
    usable = [t.device for t in run.targets if t.usable]
    detail = (
        f"{p.device_model or p.machine or 'unknown machine'}; jetson {p.is_jetson}, L4T {p.l4t_release}, "
        f"JetPack {p.jetpack}, CUDA {p.cuda_runtime}, GPU {p.gpu_name}, DLA cores {p.dla_cores}, "
        f"TensorRT {p.tensorrt_version}, ONNX Runtime {p.onnxruntime_version}; "
        f"devices to test: {', '.join(usable) or 'none'}"
    )
    data = {
        "summary": platform_summary(p),
        "targets": [{"device": t.device, "usable": t.usable, "reason": t.reason} for t in run.targets],
    }
    return Passed(detail, data)


# --------------------------------------------------------------------------- engines


def _spec(run: SelfTestRun, device: Device, precision: EnginePrecision) -> BuildSpec:
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
        artifact = run.builder.build(run.model, _spec(run, device, precision))
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


def _built(run: SelfTestRun, device: Device, precision: EnginePrecision) -> EngineArtifact:
    artifact = run.engines.get((device, precision))
    if artifact is None:
        target = next(t for t in run.targets if t.device == device)
        why = target.reason if not target.usable else f"build.{device}.{precision} failed"
        raise Skipped(why)
    return artifact


def cache_step(device: Device, precision: EnginePrecision) -> Step[SelfTestRun]:
    """Build the same engine again: it must come from the cache, with the same key."""

    def run_it(run: SelfTestRun) -> Passed:
        first = _built(run, device, precision)
        started = time.monotonic()
        again = run.builder.build(run.model, _spec(run, device, precision))
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
        artifact = _built(run, device, precision)
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


def _engine_set(run: SelfTestRun) -> tuple[ModelSource, str]:
    """One engine per usable device (its FP16 engine from the build steps); with fewer than two,
    :data:`CPU_STAND_INS` ONNX Runtime CPU sessions of the ONNX model stand in for the devices."""
    common: dict[str, Any] = {
        "model_id": "shapes",
        "version": "1",
        "intra_op_threads": 1,
        "preprocess": PreprocessSpec(width=INPUT_SIZE, height=INPUT_SIZE),
        "postprocess": ClassificationSpec(top_k=1),
    }
    built = [
        (target.device, run.engines[(target.device, "fp16")])
        for target in run.targets
        if target.usable and (target.device, "fp16") in run.engines
    ]
    sources: list[ModelSource]
    if len(built) >= 2:  # a set needs two devices
        sources = [
            ModelSource(
                path=a.engine_path,
                backend=a.backend,
                providers=tuple(a.providers),
                extra=tuple(a.load_extra.items()),
                report=EngineReport(device=device, precision=a.plan.precision, requested=device),
                **common,
            )
            for device, a in built
        ]
        what = " + ".join(device for device, _ in built)
    else:
        sources = [
            ModelSource(
                path=run.model,
                backend="onnxruntime",
                providers=("CPUExecutionProvider",),
                report=EngineReport(device="cpu", precision="fp32"),
                **common,
            )
            for _ in range(CPU_STAND_INS)
        ]
        what = f"{CPU_STAND_INS} ONNX Runtime CPU sessions standing in (fewer than two devices usable here)"
    return replace(sources[0], engines=tuple(sources[1:])), what


def multi_engine_step(run: SelfTestRun) -> Passed:
    """One slot across every usable device at once, each inference worker on its own engine: every
    frame published once, in frame order, and every engine served a share."""
    frames = run.sizes.stream_frames
    source, what = _engine_set(run)
    engines = 1 + len(source.engines)
    slot = ModelSlot("selftest-multi", parallel_runs=engines)
    slot.load(source)
    sink = ResultSink()
    spec = SyntheticSourceSpec.model_validate({"width": 160, "height": 120, "fps": 0.0, "frames": frames})
    plan = StreamPlan(
        name="synthetic",
        source=VideoSource("synthetic", spec),
        slot=slot.name,
        topic="selftest/results/synthetic",
        policy="process_all",
        queue_size=2 * engines,
    )
    pipeline = SlotPipeline(slot, [plan], sink, Metrics(), max_batch=1, workers=engines)
    deadline = time.monotonic() + max(30.0, frames / 10.0)
    pipeline.start()
    try:
        while not pipeline.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = slot.describe()["engines"]
    finally:
        pipeline.stop(time.monotonic() + 5.0)
        slot.close()
    return judge_engines([r.frame_index for r in sink.results], frames, rows, what)


def judge_engines(indices: list[int], frames: int, rows: list[dict[str, Any]], what: str) -> Passed:
    """Every frame published once and in order, and every engine of the set inferred some (pure)."""
    data = {"frames": frames, "published": len(indices), "engines": rows, "set": what}
    if indices != list(range(frames)):
        lost = sorted(set(range(frames)) - set(indices))
        raise StepFailure(
            f"{len(lost)} frame(s) lost, or results out of frame order, of {frames} (first lost: {lost[:5]})",
            data,
        )
    idle = [f"{r['index']} ({r['device']})" for r in rows if not r["frames"]]
    if idle:
        raise StepFailure(f"engine(s) {', '.join(idle)} served no frame", data)
    shares = ", ".join(f"{r['device']} {100 * r['share']:.0f}%" for r in rows)
    return Passed(f"{frames} frames in order, 0 lost, on {len(rows)} engines: {shares} ({what})", data)


# --------------------------------------------------------------------------- hot-swap


class ResultSink:
    """Stands in for the MQTT link: keeps every result the pipeline publishes (the self-test needs
    no broker; the frame path up to the publish call is the daemon's own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.results: list[ResultMessage] = []

    def publish(
        self,
        topic: str,
        payload: bytes | BaseModel,
        *,
        qos: int = 0,
        retain: bool = False,
        durable: bool = False,
    ) -> None:
        """Keep a published result."""
        message = (
            payload if isinstance(payload, ResultMessage) else ResultMessage.model_validate_json(payload)  # type: ignore[arg-type]
        )
        with self._lock:
            self.results.append(message)

    def publish_durable(
        self,
        messages: Sequence[tuple[str, bytes | BaseModel]],
        *,
        kind: Literal["state", "result"],
    ) -> list[str | None]:
        """Keep durable results too (the self-test's stream is not durable)."""
        for topic, payload in messages:
            self.publish(topic, payload)
        return [None] * len(messages)

    def count(self) -> int:
        """Results kept so far."""
        with self._lock:
            return len(self.results)


def _swap_sources(run: SelfTestRun) -> tuple[ModelSource, ModelSource, str]:
    """Two engines to swap between: the first device's FP16 then INT8 engine, else the ONNX model twice."""
    common: dict[str, Any] = {
        "model_id": "shapes",
        "intra_op_threads": 0,
        "preprocess": PreprocessSpec(width=INPUT_SIZE, height=INPUT_SIZE),
        "postprocess": ClassificationSpec(top_k=1),
        "sha256": None,
    }
    for target in run.targets:
        fp16, int8 = run.engines.get((target.device, "fp16")), run.engines.get((target.device, "int8"))
        if fp16 is not None and int8 is not None:
            sources = [
                ModelSource(
                    path=a.engine_path,
                    version=version,
                    backend=a.backend,
                    providers=tuple(a.providers),
                    extra=tuple(a.load_extra.items()),
                    **common,
                )
                for a, version in ((fp16, "fp16"), (int8, "int8"))
            ]
            return sources[0], sources[1], f"{target.device} fp16 -> int8 engine"
    plain = [
        ModelSource(
            path=run.model, version=v, backend="onnxruntime", providers=("CPUExecutionProvider",), **common
        )
        for v in ("1", "2")
    ]
    return plain[0], plain[1], "ONNX model on ONNX Runtime CPU, version 1 -> 2 (no engine pair built)"


def hotswap_step(run: SelfTestRun) -> Passed:
    """A synthetic stream through a real slot and pipeline; swap engines mid-stream; lose no frame."""
    frames = run.sizes.stream_frames
    first, second, what = _swap_sources(run)
    slot = ModelSlot("selftest")
    slot.load(first)
    sink = ResultSink()
    spec = SyntheticSourceSpec.model_validate({"width": 160, "height": 120, "fps": 100.0, "frames": frames})
    plan = StreamPlan(
        name="synthetic",
        source=VideoSource("synthetic", spec),
        slot=slot.name,
        topic="selftest/results/synthetic",
        policy="process_all",
        queue_size=4,
    )
    pipeline = SlotPipeline(slot, [plan], sink, Metrics(), max_batch=4)
    deadline = time.monotonic() + max(30.0, frames / 10.0)
    pipeline.start()
    try:
        while sink.count() < frames // 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        slot.load(second)  # the swap, while frames keep coming
        while not pipeline.finished and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pipeline.stop(time.monotonic() + 5.0)
        slot.close()
    return _judge_swap(sink.results, frames, slot.swaps, first.version, second.version, what)


def _judge_swap(  # noqa: PLR0917 - pure check with one call site
    results: list[ResultMessage], frames: int, swaps: int, old: str | None, new: str | None, what: str
) -> Passed:
    """Every frame published exactly once, in order, old version then new, one swap (pure)."""
    indices = [r.frame_index for r in results]
    versions = [r.model.version for r in results]
    data = {"frames": frames, "published": len(indices), "swaps": swaps, "swapped": what}
    if sorted(indices) != list(range(frames)):
        lost = sorted(set(range(frames)) - set(indices))
        raise StepFailure(
            f"{len(lost)} frame(s) lost or {len(indices) - len(set(indices))} repeated of {frames} "
            f"(first lost: {lost[:5]})",
            data,
        )
    ordered = [v for _, v in sorted(zip(indices, versions, strict=True))]
    if new not in ordered or swaps != 1:
        raise StepFailure(f"the swap did not happen while streaming ({swaps} swap(s))", data)
    switch = ordered.index(new)
    if switch == 0 or set(ordered[:switch]) != {old} or set(ordered[switch:]) != {new}:
        raise StepFailure("results mix the two versions after the swap", data)
    data["switch_frame"] = switch
    return Passed(f"{frames} frames, 0 lost, swapped at frame {switch} ({what})", data)


# --------------------------------------------------------------------------- telemetry, CUDA

#: Fields a Jetson's sysfs gives the agent (temperatures are ``temp.*``).
JETSON_FIELDS = ("gpu.load_percent", "gpu.freq_mhz")
DLA_CLOCK_FIELDS = ("dla0.freq_mhz", "dla1.freq_mhz")


def telemetry_step(run: SelfTestRun, root: Path = Path("/")) -> Passed:
    """Read the device statistics telemetry publishes; on a Jetson, GPU load and clock must be there."""
    stats = DeviceStats(root)
    time.sleep(0.2)  # cpu_percent measures since the previous call
    values = stats.collect()
    temps = sorted(k for k in values if k.startswith("temp."))
    present = [k for k in (*JETSON_FIELDS, *DLA_CLOCK_FIELDS, "emc.freq_mhz") if k in values]
    data: dict[str, Any] = {"fields": values}
    if not run.platform.is_jetson:
        raise Skipped(
            f"not a Jetson ({run.platform.reasons.get('l4t_release', 'no L4T release')}): no GPU/DLA sysfs "
            f"here; read {len(values)} fields ({len(temps)} temperatures)"
        )
    missing = [k for k in JETSON_FIELDS if k not in values]
    if not temps:
        missing.append("temp.*")
    if missing:
        raise StepFailure(f"not found in sysfs: {', '.join(missing)}", data)
    dla = [k for k in DLA_CLOCK_FIELDS if k in values]
    dla_note = (
        ", ".join(f"{k} {values[k]:.0f}" for k in dla)
        if dla
        else "DLA clocks unreadable (debugfs needs root)"
    )
    detail = (
        f"{len(temps)} temperatures ({', '.join(f'{k} {values[k]:.1f}' for k in temps[:4])}), "
        f"GPU load {values['gpu.load_percent']:.1f} %, GPU {values['gpu.freq_mhz']:.0f} MHz, {dla_note}"
    )
    data["present"] = present
    return Passed(detail, data)


def _cuda() -> Any:
    from agent.backends import cuda

    usable, why = cuda.cuda_status()
    if not usable:
        raise Skipped(why)
    return cuda


def cuda_buffers_step(_run: SelfTestRun) -> Passed:
    """Host -> device -> host through pinned buffers and a non-blocking stream, bit for bit."""
    cuda = _cuda()
    checked = 0
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float16, np.uint8, np.int32):
        for shape in ((1,), (1, 3, INPUT_SIZE, INPUT_SIZE), (4, 1 << 18)):
            data = (rng.random(shape) * 100).astype(dtype)
            with (
                cuda.PinnedBuffer(shape, dtype) as src,
                cuda.PinnedBuffer(shape, dtype) as dst,
                cuda.DeviceBuffer(data.nbytes) as dev,
                cuda.Stream() as stream,
            ):
                src.array[...] = data
                dst.array[...] = 0
                cuda.copy_htod_async(dev, src.array, stream)
                cuda.copy_dtoh_async(dst.array, dev, stream)
                stream.synchronize()
                if not np.array_equal(dst.array, data):
                    raise StepFailure(f"round trip of {dtype.__name__} {shape} came back different")
            checked += 1
    free, total = cuda.mem_get_info()
    return Passed(
        f"{checked} round trips (4 dtypes x 3 shapes) equal bit for bit; "
        f"device memory {free / 2**20:.0f} of {total / 2**20:.0f} MiB free",
        {"round_trips": checked, "free_bytes": free, "total_bytes": total},
    )


def cuda_leak_step(run: SelfTestRun) -> Passed:
    """Allocate / copy / free 1 MiB buffers many times: free device memory must not drop."""
    cuda = _cuda()
    nbytes = 1 << 20
    data = np.arange(nbytes // 4, dtype=np.float32)
    cycles = run.sizes.leak_cycles

    def cycle(stream: Any) -> None:
        with cuda.DeviceBuffer(nbytes) as dev, cuda.PinnedBuffer(data.shape, data.dtype) as host:
            cuda.copy_htod_async(dev, data, stream)
            cuda.copy_dtoh_async(host.array, dev, stream)
            stream.synchronize()

    with cuda.Stream() as stream:
        cycle(stream)  # first touch: lets the allocator and context settle before measuring
        free_before, total = cuda.mem_get_info()
        for _ in range(cycles):
            cycle(stream)
        free_after, _ = cuda.mem_get_info()
    leaked = free_before - free_after
    data_out = {"cycles": cycles, "free_before": free_before, "free_after": free_after, "total": total}
    line = (
        f"{cycles} cycles of 1 MiB: free {free_before / 2**20:.1f} -> {free_after / 2**20:.1f} MiB "
        f"of {total / 2**20:.0f} (difference {leaked / 2**20:.2f} MiB)"
    )
    if leaked >= LEAK_TOLERANCE_BYTES:
        raise StepFailure(f"device memory leaks: {line}", data_out)
    return Passed(line, data_out)


# --------------------------------------------------------------------------- the row


def all_steps() -> list[Step[SelfTestRun]]:
    """Every step, in the order it runs."""
    steps: list[Step[SelfTestRun]] = [
        Step(
            "platform",
            BUDGET_S["platform"],
            "what this machine is, and which devices the rest tests",
            platform_step,
        )
    ]
    engines = [(d, p) for d in ("gpu", "dla0", "dla1", "cpu") for p in PRECISIONS]
    for device, precision in engines:
        steps.append(build_step(device, precision))  # type: ignore[arg-type]
        steps.append(cache_step(device, precision))  # type: ignore[arg-type]
        steps.append(throughput_step(device, precision))  # type: ignore[arg-type]
    steps += [
        Step(
            "compare.backends",
            BUDGET_S["compare.backends"],
            "build --bench: every backend here runs the same model and input (output differences listed)",
            compare_step,
        ),
        Step(
            "multi_engine.slot",
            BUDGET_S["multi_engine.slot"],
            "one slot serves frames from engines on every usable device at once",
            multi_engine_step,
        ),
        Step(
            "hotswap.synthetic_stream",
            BUDGET_S["hotswap.synthetic_stream"],
            "a hot-swap under a live stream loses no frame and never mixes versions",
            hotswap_step,
        ),
        Step(
            "telemetry.sysfs",
            BUDGET_S["telemetry.sysfs"],
            "telemetry reads this device's temperatures, GPU load and clocks (and DLA clocks as root)",
            telemetry_step,
        ),
        Step(
            "cuda.buffers",
            BUDGET_S["cuda.buffers"],
            "the CUDA wrappers TensorRT runs on copy data through pinned memory and streams intact",
            cuda_buffers_step,
        ),
        Step(
            "cuda.leak_check",
            BUDGET_S["cuda.leak_check"],
            "allocating and freeing CUDA buffers does not leak device memory",
            cuda_leak_step,
        ),
    ]
    return steps
