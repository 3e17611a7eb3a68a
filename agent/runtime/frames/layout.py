"""How many inference workers a slot runs, decided once from its config, streams and the machine.

Pure: the composition root passes in what it knows and gets back a number with the reason, which is
logged and shown in status. One single-threaded ONNX Runtime run per core, side by side, beats one
run spread over every core (``bench/pipeline.py`` compares them), because a run's own threads wait
on each other at every operator while two independent runs never do. The price is latency: one
frame takes a whole single-threaded run. So the throughput layout is chosen only where nothing waits
on a single frame: unpaced files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.backends.base import SMALL_MODEL_MS, ProviderRequest
from agent.camera.source_spec import FileSourceSpec
from agent.config import SlotConfig, StreamConfig

#: Throughput layout: at most this many workers, whatever the core count (each holds a batch and a
#: copy of the activations; past four, memory grows faster than throughput on an 8-core Orin CPU).
MAX_AUTO_WORKERS = 4

#: Throughput layout: results the publisher waits for before it is woken (:mod:`agent.runtime.frames.outbox`).
#: Nothing waits on a single result of an unpaced file, and a wake-up per result cost more CPU than
#: publishing it on two busy cores; a few results per wake-up is enough.
THROUGHPUT_PUBLISH_WAKE = 4

_CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class Layout:
    """Inference threads of a slot, the largest batch they take (None: the slot's ``max_batch``), and why.

    ``publish_wake``: ready results that wake the slot's publish thread (1: each one as it is ready).
    """

    workers: int
    reason: str
    max_batch: int | None = None
    publish_wake: int = 1


def _provider_name(request: ProviderRequest) -> str:
    return request if isinstance(request, str) else request[0]


def inference_layout(
    configured: int,
    *,
    backend: str,
    providers: Sequence[ProviderRequest],
    cpus: int,
    unpaced_only: bool,
    model_ms: float | None = None,
    engines: int = 1,
) -> Layout:
    """Workers for a slot. ``configured`` > 0 wins; 0 is auto.

    A slot on several engines (``build.devices``) runs at least one worker per engine, each worker
    owning one: fewer would leave a device idle, and that is the point of the set.

    Auto gives one worker per core (up to :data:`MAX_AUTO_WORKERS`) only when the slot runs on
    ONNX Runtime's CPU provider alone and every stream feeding it is an unpaced file
    (``unpaced_only``); a GPU, DLA or TensorRT engine serialises runs on the device anyway, and a
    live or paced stream wants each frame back as soon as possible, which one run over every core does.
    ``model_ms`` (a batch-1 run on one thread, when measured) keeps a small model on one worker: its
    runs are shorter than a frame's decode, so a second worker would only split batches in two.
    """
    if engines > 1 and configured < engines:
        return Layout(engines, f"one worker per engine ({engines} engines: build.devices)")
    if configured > 0:
        return Layout(configured, "configured")
    if backend != "onnxruntime":
        return Layout(1, f"auto: backend {backend} runs one engine context")
    accelerators = [name for name in map(_provider_name, providers) if name != _CPU]
    if accelerators:
        return Layout(1, f"auto: provider {accelerators[0]} runs on a device")
    if not unpaced_only:
        return Layout(1, "auto: a live or paced stream: one run over every core for the lowest latency")
    if cpus < 2:
        return Layout(1, "auto: one core")
    if model_ms is not None and model_ms < SMALL_MODEL_MS:
        return Layout(1, f"auto: a small model ({model_ms:.2f} ms per frame) needs one worker")
    workers = min(cpus, MAX_AUTO_WORKERS)
    # One frame per run: on the CPU provider a batch costs the same per frame as single frames, and a
    # batch of 4 on one thread makes each result wait for three others and come out in bursts.
    return Layout(
        workers,
        f"auto: unpaced files on {cpus} cores: {workers} single-threaded runs of one frame",
        max_batch=1,
        publish_wake=THROUGHPUT_PUBLISH_WAKE,
    )


def unpaced(stream: StreamConfig) -> bool:
    """A stream read as fast as the slot takes it: a file, not paced, not rate-limited, every frame kept."""
    source = stream.source
    return (
        isinstance(source, FileSourceSpec)
        and not source.realtime
        and stream.fps_limit is None
        and stream.drop_policy != "keep_newest"
    )


def slot_layout(
    slot: SlotConfig,
    streams: Sequence[StreamConfig],
    cpus: int,
    model_ms: float | None = None,
    engines: int | None = None,
) -> Layout:
    """:func:`inference_layout` for a configured slot and the streams that feed it.

    ``engines``: the engines of the slot's loaded set; unknown (None), the length of a listed
    ``build.devices`` (``auto`` is known once the set is built)."""
    if engines is None:
        devices = slot.build.devices if slot.build is not None else None
        engines = len(devices) if isinstance(devices, list) else 1
    return inference_layout(
        slot.inference_workers,
        backend=slot.backend,
        providers=slot.providers,
        cpus=cpus,
        unpaced_only=bool(streams) and all(unpaced(s) for s in streams),
        model_ms=model_ms,
        engines=engines,
    )
