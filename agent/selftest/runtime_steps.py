"""The runtime steps: one slot on several engines, and a hot-swap under a live synthetic stream with
no frame lost and no version mixed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel

from agent.camera.source import VideoSource
from agent.camera.source_spec import SyntheticSourceSpec
from agent.protocol.messages import ResultMessage
from agent.runtime.frames.pipeline import SlotPipeline
from agent.runtime.frames.stage_items import StreamPlan
from agent.runtime.slots.loaded import EngineReport, ModelSource
from agent.runtime.slots.slot import ModelSlot
from agent.selftest.run import CPU_STAND_INS, INPUT_SIZE, SelfTestRun
from agent.selftest.step import Passed, StepFailure
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from agent.telemetry import Metrics


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
    with _streaming(slot, frames, fps=0.0, max_batch=1, workers=engines) as (pipeline, sink, deadline):
        _wait(lambda: pipeline.finished, deadline, 0.05)
        rows = slot.describe()["engines"]
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
    with _streaming(slot, frames, fps=100.0, max_batch=4) as (pipeline, sink, deadline):
        _wait(lambda: sink.count() >= frames // 4, deadline, 0.02)
        slot.load(second)  # the swap, while frames keep coming
        _wait(lambda: pipeline.finished, deadline, 0.05)
    return _judge_swap(sink.results, frames, slot.swaps, first.version, second.version, what)


@contextmanager
def _streaming(
    slot: ModelSlot, frames: int, *, fps: float, max_batch: int, workers: int = 1
) -> Iterator[tuple[SlotPipeline, ResultSink, float]]:
    """A synthetic stream of ``frames`` through ``slot`` with a real pipeline, results kept in a sink:
    yields (pipeline, sink, deadline); stops the pipeline and closes the slot on the way out."""
    sink = ResultSink()
    spec = SyntheticSourceSpec.model_validate({"width": 160, "height": 120, "fps": fps, "frames": frames})
    plan = StreamPlan(
        name="synthetic",
        source=VideoSource("synthetic", spec),
        slot=slot.name,
        topic="selftest/results/synthetic",
        policy="process_all",
        queue_size=max(4, 2 * workers),
    )
    pipeline = SlotPipeline(slot, [plan], sink, Metrics(), max_batch=max_batch, workers=workers)
    deadline = time.monotonic() + max(30.0, frames / 10.0)
    pipeline.start()
    try:
        yield pipeline, sink, deadline
    finally:
        pipeline.stop(time.monotonic() + 5.0)
        slot.close()


def _wait(done: Callable[[], bool], deadline: float, poll_s: float) -> None:
    while not done() and time.monotonic() < deadline:
        time.sleep(poll_s)


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
