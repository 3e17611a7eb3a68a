"""What travels along the frame path: a stream's plan, its metrics, frame taps, the items between
stages, and the publisher the last stage hands results to.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from agent.camera.frame import Frame
from agent.camera.framing import Framing
from agent.camera.preprocess import Letterbox
from agent.camera.source import VideoSource
from agent.runtime.frames.stage_queue import DropPolicy
from agent.runtime.slots.loaded import LoadedModel
from agent.specs.preprocess import PreprocessSpec
from agent.telemetry import Metrics


class Publisher(Protocol):
    """What the pipeline needs of the MQTT link."""

    def publish(
        self,
        topic: str,
        payload: bytes | BaseModel,
        *,
        qos: int = 0,
        retain: bool = False,
        durable: bool = False,
    ) -> None: ...

    def publish_durable(
        self, messages: Sequence[tuple[str, bytes | BaseModel]], *, kind: Literal["state", "result"]
    ) -> list[str | None]: ...


@dataclass(frozen=True)
class StreamTuning:
    """What a config reload changes on a running stream, without touching its source or any other
    stream: its rate limit (``fps_limit``) and its framing (``rotate``, ``roi``)."""

    fps_limit: float | None = None
    framing: Framing = field(default_factory=Framing)


class TuningDial:
    """A stream's tuning, replaced whole by a reload (one attribute store) and read once per frame
    by the stream's capture thread, so a frame never sees half of an old and half of a new one."""

    def __init__(self, tuning: StreamTuning | None = None) -> None:
        self.current = tuning or StreamTuning()


@dataclass(frozen=True)
class StreamPlan:
    """A stream as the pipeline runs it."""

    name: str
    source: VideoSource
    slot: str
    topic: str
    policy: DropPolicy
    queue_size: int = 4
    tuning: TuningDial = field(default_factory=TuningDial)
    qos: int = 0
    durable: bool = False


class StreamMetrics:
    """A stream's metric handles, looked up once: the frame path never formats a metric name."""

    def __init__(self, metrics: Metrics, stream: str) -> None:
        prefix = f"stream.{stream}"
        self.captured = metrics.counter(f"{prefix}.frames_captured")
        self.inferred = metrics.counter(f"{prefix}.frames_inferred")
        self.published = metrics.counter(f"{prefix}.frames_published")
        self.dropped = {
            reason: metrics.counter(f"{prefix}.dropped.{reason}")
            for reason in ("fps_limit", "no_model", "shutdown", "queue_full", "infer_error", "publish_error")
        }
        self.preprocess = metrics.histogram(f"{prefix}.latency.preprocess")
        self.postprocess = metrics.histogram(f"{prefix}.latency.postprocess")
        self.queue = metrics.histogram(f"{prefix}.latency.queue")
        self.total = metrics.histogram(f"{prefix}.latency.total")


class FrameTap:
    """Collects copies of every ``every``-th frame until it has ``n``."""

    def __init__(self, n: int, every: int) -> None:
        self.n = n
        self.every = max(1, every)
        self.frames: list[npt.NDArray[np.uint8]] = []
        self.done = threading.Event()
        self._seen = 0

    def offer(self, image: npt.NDArray[np.uint8]) -> None:
        if self.done.is_set():
            return
        self._seen += 1
        if (self._seen - 1) % self.every == 0:
            self.frames.append(image.copy())
            if len(self.frames) >= self.n:
                self.done.set()


@dataclass(slots=True)
class WorkItem:
    """A preprocessed frame on its way to inference."""

    frame: Frame
    #: None while the frame waits for GPU preprocessing in the inference worker.
    tensor: npt.NDArray[Any] | None
    letterbox: Letterbox
    spec: PreprocessSpec
    plan: StreamPlan
    pre_ms: float
    queued_mono: float = 0.0


@dataclass(slots=True)
class InferredItem:
    """A frame's outputs (batch axis removed) and the model that produced them."""

    work: WorkItem
    outputs: dict[str, npt.NDArray[Any]]
    model: LoadedModel
    queue_ms: float
    infer_ms: float
    batch: int
    extra: dict[str, float] = field(default_factory=dict)
