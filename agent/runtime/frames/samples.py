"""Samples for retraining: the frames a slot's model was unsure of, kept at a bounded rate.

Opt-in per slot (``samples.enabled``, off by default). :meth:`Sampler.offer` is the one call on the
frame path, made by the slot's :class:`~agent.runtime.frames.snapshots.SnapshotBoard` when it pairs a
published result with its frame (so the pipeline itself is untouched; with batches that is the
newest frame of each stream per batch). It looks at the result (no copy, no encode) and, when the
frame is a sample and the sliding 60 s window still has room for one (``per_minute``), keeps a
reference to the image (one the capture owns and no stage writes to again) in a queue of at most
``_QUEUE`` frames. :class:`SamplePublisher` (one thread) then encodes each as a JPEG within
``max_bytes`` and the payload limit, off the frame path, and publishes it on ``up/samples``.

A frame is a sample when a classifier's top-1 score, or any detector box's score, is below
``max_confidence`` (``low_confidence``), or when a detector reports more than ``max_detections``
boxes or a score is NaN (``unusual``).
"""

from __future__ import annotations

import base64
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from agent.camera.jpeg import encode_jpeg
from agent.config.models import SamplesConfig
from agent.errors import AgentError
from agent.protocol.messages import ResultMessage
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.samples import SampleMessage, SampleReason
from agent.runtime.slots.evidence import bounded_prediction

#: Frames waiting to be encoded; the rate bounds how many arrive, this bounds a stalled publisher.
_QUEUE = 4
#: Bytes kept free in a sample for the JSON around the base64 text and the prediction.
_MESSAGE_SLACK = 8 * 1024
_WINDOW_S = 60.0
_QUALITY = 85


log = structlog.get_logger(__name__)


def sample_reason(
    classes: list[ClassScore] | None, detections: list[Detection] | None, config: SamplesConfig
) -> SampleReason | None:
    """Why a frame with these classes or detections is a sample, or None if it is not."""
    if classes:
        if any(math.isnan(c.score) for c in classes):
            return "unusual"
        top = max(c.score for c in classes)
        return "low_confidence" if top < config.max_confidence else None
    if detections is not None:
        if len(detections) > config.max_detections:
            return "unusual"
        if any(math.isnan(d.score) for d in detections):
            return "unusual"
        if any(d.score < config.max_confidence for d in detections):
            return "low_confidence"
    return None


@dataclass(frozen=True)
class _Candidate:
    image: npt.NDArray[np.uint8]
    result: ResultMessage
    reason: SampleReason


class Sampler:
    """One slot's sampler (thread-safe): :meth:`offer` on the frame path, :meth:`take` off it."""

    def __init__(
        self,
        config: SamplesConfig,
        slot: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_kept: Callable[[], None] | None = None,
    ) -> None:
        """``on_kept()`` is called (outside the lock) when a frame is kept: it wakes the publisher."""
        self.config = config
        self.slot = slot
        self._clock = clock
        self.on_kept = on_kept
        self._taken: deque[float] = deque()
        self._queue: deque[_Candidate] = deque()
        self._lock = threading.Lock()
        #: Frames that were samples but over the rate or the queue: counted, not kept.
        self.skipped = 0

    def offer(self, image: npt.NDArray[np.uint8], result: ResultMessage) -> bool:
        """Keep a reference to the frame if it is a sample and the rate allows; True if kept."""
        if not self.config.enabled:
            return False
        reason = sample_reason(result.classes, result.detections, self.config)
        if reason is None:
            return False
        now = self._clock()
        with self._lock:
            while self._taken and now - self._taken[0] >= _WINDOW_S:
                self._taken.popleft()
            if len(self._taken) >= self.config.per_minute or len(self._queue) >= _QUEUE:
                self.skipped += 1
                return False
            self._taken.append(now)
            self._queue.append(_Candidate(image, result, reason))
        if self.on_kept is not None:
            self.on_kept()
        return True

    def pending(self) -> int:
        """Frames kept and not yet taken."""
        with self._lock:
            return len(self._queue)

    def take(self, payload_limit: int) -> SampleMessage | None:
        """The oldest kept frame as an ``up/samples`` message (JPEG encoded now), or None if none.

        The JPEG fits ``max_bytes`` and what ``payload_limit`` leaves once the rest is counted;
        raises SnapshotTooLargeError when even the smallest JPEG does not (the frame is dropped).
        """
        with self._lock:
            if not self._queue:
                return None
            candidate = self._queue.popleft()
        budget = min(self.config.max_bytes, (max(0, payload_limit - _MESSAGE_SLACK) * 3) // 4)
        jpeg = encode_jpeg(candidate.image, self.config.max_dimension, budget, _QUALITY)
        height, width = candidate.image.shape[:2]
        result = candidate.result
        prediction = Prediction(classes=result.classes, detections=result.detections)
        bounded = bounded_prediction(prediction)
        total = bounded.pop("detections_total", None)
        return SampleMessage(
            msg_id=uuid.uuid4().hex,
            ts=result.captured_at,
            slot=self.slot,
            stream=result.stream,
            model_id=result.model.model_id,
            model_version=result.model.version,
            frame=result.frame_index,
            reason=candidate.reason,
            width=jpeg.width,
            height=jpeg.height,
            source_width=width,
            source_height=height,
            jpeg_b64=base64.b64encode(jpeg.data).decode("ascii"),
            prediction=Prediction.model_validate(bounded),
            detections_total=total,
        )


class SamplePublisher:
    """One thread: encodes the samplers' kept frames and publishes them on ``up/samples`` (QoS 1).

    A frame that cannot fit the payload limit, or a publish that fails, is logged and dropped: a
    sample is never worth holding up the device or retrying for ever.
    """

    def __init__(
        self,
        samplers: list[Sampler],
        publish: Callable[[SampleMessage], None],
        payload_limit: Callable[[], int],
        stop: threading.Event,
    ) -> None:
        self.samplers = samplers
        self._publish = publish
        self._payload_limit = payload_limit
        self._stop = stop
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="samples", daemon=True)
        #: Samples published, and samples dropped (too large to fit, or the publish failed).
        self.published = 0
        self.dropped = 0
        for sampler in samplers:
            sampler.on_kept = self._wake.set

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        """``published``, ``dropped`` and ``skipped`` (samples over the rate or the queue)."""
        return {
            "published": float(self.published),
            "dropped": float(self.dropped),
            "skipped": float(sum(s.skipped for s in self.samplers)),
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            self.drain()

    def drain(self) -> None:
        """Publish every kept frame now (the thread's loop; tests call it directly too)."""
        for sampler in self.samplers:
            while not self._stop.is_set():
                try:
                    message = sampler.take(self._payload_limit())
                    if message is None:
                        break
                    self._publish(message)
                    self.published += 1
                except AgentError as exc:
                    self.dropped += 1
                    log.warning("samples.dropped", slot=sampler.slot, error=str(exc))
                except Exception:  # the link refused it (oversize, closing): drop, keep the thread
                    self.dropped += 1
                    log.exception("samples.publish_failed", slot=sampler.slot)
