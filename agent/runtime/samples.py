"""Samples for retraining: the frames a slot's model was unsure of, kept at a bounded rate.

Opt-in per slot (``samples.enabled``, off by default). :meth:`Sampler.offer` is the one call on the
frame path: it looks at the prediction (no copy, no encode) and, when the frame is a sample and the
sliding 60 s window still has room for one (``per_minute``), keeps a reference to the image (one the
capture owns and no stage writes to again, like the snapshot board's) in a queue of at most
``_QUEUE`` frames. :meth:`Sampler.take` encodes the oldest as a JPEG within ``max_bytes`` and the
payload limit, off the frame path, and gives the ``up/samples`` message to publish.

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

from agent.config.models import SamplesConfig
from agent.protocol.results import Prediction
from agent.protocol.samples import SampleMessage, SampleReason
from agent.runtime.evidence import bounded_prediction
from agent.runtime.snapshot_command import encode_jpeg

#: Frames waiting to be encoded; the rate bounds how many arrive, this bounds a stalled publisher.
_QUEUE = 4
#: Bytes kept free in a sample for the JSON around the base64 text and the prediction.
_MESSAGE_SLACK = 8 * 1024
_WINDOW_S = 60.0
_QUALITY = 85


def sample_reason(prediction: Prediction, config: SamplesConfig) -> SampleReason | None:
    """Why this prediction makes its frame a sample, or None if it does not."""
    if prediction.classes:
        if any(math.isnan(c.score) for c in prediction.classes):
            return "unusual"
        top = max(prediction.classes, key=lambda c: c.score)
        return "low_confidence" if top.score < config.max_confidence else None
    if prediction.detections is not None:
        if len(prediction.detections) > config.max_detections:
            return "unusual"
        if any(math.isnan(d.score) for d in prediction.detections):
            return "unusual"
        if any(d.score < config.max_confidence for d in prediction.detections):
            return "low_confidence"
    return None


@dataclass(frozen=True)
class _Candidate:
    image: npt.NDArray[np.uint8]
    prediction: Prediction
    stream: str
    frame: int
    reason: SampleReason
    ts: float


class Sampler:
    """One slot's sampler (thread-safe): :meth:`offer` on the frame path, :meth:`take` off it."""

    def __init__(
        self,
        config: SamplesConfig,
        slot: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.slot = slot
        self._clock = clock
        self._wall = wall
        self._taken: deque[float] = deque()
        self._queue: deque[_Candidate] = deque()
        self._lock = threading.Lock()
        #: Frames that were samples but over the rate or the queue: counted, not kept.
        self.skipped = 0

    def offer(self, image: npt.NDArray[np.uint8], prediction: Prediction, stream: str, frame: int) -> bool:
        """Keep a reference to the frame if it is a sample and the rate allows; True if kept."""
        if not self.config.enabled:
            return False
        reason = sample_reason(prediction, self.config)
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
            self._queue.append(_Candidate(image, prediction, stream, frame, reason, self._wall()))
            return True

    def pending(self) -> int:
        """Frames kept and not yet taken."""
        with self._lock:
            return len(self._queue)

    def take(self, model_id: str, model_version: str | None, payload_limit: int) -> SampleMessage | None:
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
        bounded = bounded_prediction(candidate.prediction)
        total = bounded.pop("detections_total", None)
        return SampleMessage(
            msg_id=uuid.uuid4().hex,
            ts=candidate.ts,
            slot=self.slot,
            stream=candidate.stream,
            model_id=model_id,
            model_version=model_version,
            frame=candidate.frame,
            reason=candidate.reason,
            width=jpeg.width,
            height=jpeg.height,
            source_width=width,
            source_height=height,
            jpeg_b64=base64.b64encode(jpeg.data).decode("ascii"),
            prediction=Prediction.model_validate(bounded),
            detections_total=total,
        )
