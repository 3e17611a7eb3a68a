"""Why a candidate was rejected: the live frames it disagreed on most, with both models' outputs.

A shadow run (:mod:`agent.runtime.slots.shadow`) offers every compared frame to a
:class:`DisagreementHeap`, which keeps the ``frames`` of lowest agreement. It holds a reference to
the image (one the capture owns and no stage writes to again, like the snapshot board's), never a
copy, and only while the frame is among the kept ones; nothing is encoded during the run. (A
probation that ends unhealthy fills a heap the same way, from both models on its last live frames:
:mod:`agent.runtime.slots.guarded`.) When the candidate is rejected, :meth:`EvidenceStore.keep` encodes
those frames as JPEGs (each within the byte budget, scaled to ``max_dimension``) and keeps them,
with both models' outputs cut to a bounded size, for the last ``jobs`` rejected jobs (oldest
dropped). The ``evidence`` command (:class:`EvidenceCommand`) answers an index of a job's frames,
then one frame per request: a reply never carries more than one JPEG, so each fits the MQTT payload
limit.

Held in memory: a restart of the agent forgets them (the job's status still says how many there were).
"""

from __future__ import annotations

import base64
import heapq
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from agent.camera.jpeg import SnapshotTooLargeError, encode_jpeg
from agent.errors import AgentError
from agent.protocol.command_args import EvidenceArgs
from agent.protocol.messages import CommandReply, EvidenceSummary, encode
from agent.protocol.results import Prediction

#: Classes, boxes and tensor values kept of each model's output per frame (the rest is cut).
_MAX_CLASSES = 5
_MAX_DETECTIONS = 20
_MAX_TENSOR_VALUES = 16
#: Bytes kept free in a frame reply for the JSON around the base64 text.
_REPLY_SLACK = 512


class NoEvidenceError(AgentError):
    """The device keeps no evidence for this job (never rejected here, or dropped since)."""

    code = "no_evidence"


class NoSuchFrameError(AgentError):
    """The request names a frame number the job's evidence does not have."""

    code = "no_such_frame"


@dataclass(frozen=True)
class EvidenceBounds:
    """How much evidence a device keeps: frames per job, jobs, and the size of each JPEG."""

    frames: int = 6
    jobs: int = 8
    max_dimension: int = 640
    frame_bytes: int = 64 * 1024
    quality: int = 80

    @property
    def max_bytes(self) -> int:
        """The most JPEG bytes the store can hold at once."""
        return self.frames * self.jobs * self.frame_bytes


@dataclass(frozen=True)
class Disagreement:
    """One compared frame: the image (a reference) and what each model said of it."""

    agreement: float
    image: npt.NDArray[np.uint8]
    serving: Prediction
    candidate: Prediction
    #: Why the frame counts beyond its agreement (e.g. the candidate's outputs were NaN).
    note: str | None = None


class DisagreementHeap:
    """The ``size`` frames of lowest agreement offered so far (thread-safe; ties: the earlier stays)."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Max-heap on agreement (negated): its top is the kept frame that agrees most, the next out.
        self._heap: list[tuple[float, int, Disagreement]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    def offer(
        self,
        agreement: float,
        image: npt.NDArray[np.uint8],
        serving: Prediction,
        candidate: Prediction,
        note: str | None = None,
    ) -> bool:
        """Keep the frame if it is among the ``size`` lowest so far; True if kept."""
        if self.size <= 0:
            return False
        with self._lock:
            if len(self._heap) >= self.size and agreement >= -self._heap[0][0]:
                return False
            item = (-agreement, -next(self._order), Disagreement(agreement, image, serving, candidate, note))
            if len(self._heap) < self.size:
                heapq.heappush(self._heap, item)
            else:
                heapq.heapreplace(self._heap, item)
            return True

    def worst_first(self) -> list[Disagreement]:
        """The kept frames, lowest agreement first (the earlier one first on a tie)."""
        with self._lock:
            return [d for _, _, d in sorted(self._heap, key=lambda t: (-t[0], -t[1]))]

    def __len__(self) -> int:
        return len(self._heap)


def bounded_prediction(prediction: Prediction) -> dict[str, Any]:
    """``prediction`` as JSON, cut to the top classes/boxes by score and the first tensor values."""
    out: dict[str, Any] = {}
    if prediction.classes is not None:
        top = sorted(prediction.classes, key=lambda c: -_score(c.score))[:_MAX_CLASSES]
        out["classes"] = [c.model_dump(mode="json") for c in top]
    if prediction.detections is not None:
        boxes = sorted(prediction.detections, key=lambda d: -_score(d.score))
        out["detections"] = [d.model_dump(mode="json") for d in boxes[:_MAX_DETECTIONS]]
        if len(boxes) > _MAX_DETECTIONS:
            out["detections_total"] = len(boxes)
    if prediction.tensors is not None:
        out["tensors"] = [
            {
                "name": t.name,
                "shape": t.shape,
                "values": t.values[:_MAX_TENSOR_VALUES],
                "truncated": t.truncated or len(t.values) > _MAX_TENSOR_VALUES,
            }
            for t in prediction.tensors
        ]
    return out


@dataclass(frozen=True)
class EvidenceFrame:
    """One kept frame: the JPEG and both models' (bounded) outputs on it."""

    agreement: float
    jpeg: bytes
    width: int
    height: int
    source_width: int
    source_height: int
    serving: dict[str, Any]
    candidate: dict[str, Any]
    note: str | None

    def meta(self, number: int) -> dict[str, Any]:
        """What the index says of this frame (no outputs, no JPEG)."""
        out: dict[str, Any] = {
            "frame": number,
            "agreement": round(self.agreement, 4),
            "width": self.width,
            "height": self.height,
            "source_width": self.source_width,
            "source_height": self.source_height,
            "bytes": len(self.jpeg),
        }
        if self.note is not None:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class JobEvidence:
    """The evidence of one rejected job."""

    job_id: str
    slot: str
    reason: str
    serving_model: str
    candidate_model: str
    frames: list[EvidenceFrame] = field(default_factory=list)

    def summary(self) -> EvidenceSummary:
        return EvidenceSummary(frames=len(self.frames), bytes=sum(len(f.jpeg) for f in self.frames))

    def index(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "slot": self.slot,
            "reason": self.reason,
            "serving_model": self.serving_model,
            "candidate_model": self.candidate_model,
            "frames": [f.meta(i) for i, f in enumerate(self.frames)],
        }


class EvidenceStore:
    """The evidence of the last ``bounds.jobs`` rejected jobs (thread-safe; oldest dropped first)."""

    def __init__(self, bounds: EvidenceBounds | None = None) -> None:
        self.bounds = bounds or EvidenceBounds()
        self._jobs: OrderedDict[str, JobEvidence] = OrderedDict()
        self._lock = threading.Lock()

    def heap(self) -> DisagreementHeap:
        """An empty heap sized for one job's evidence."""
        return DisagreementHeap(self.bounds.frames)

    def keep(
        self,
        job_id: str,
        *,
        slot: str,
        reason: str,
        serving_model: str,
        candidate_model: str,
        heap: DisagreementHeap,
    ) -> EvidenceSummary:
        """Encode the heap's frames (now, once) and keep them under ``job_id``; their count and bytes."""
        b = self.bounds
        frames = []
        for d in heap.worst_first():
            try:
                jpeg = encode_jpeg(d.image, b.max_dimension, b.frame_bytes, b.quality)
            except SnapshotTooLargeError:
                continue  # a budget too small for this frame: the others may still fit
            frames.append(
                EvidenceFrame(
                    agreement=d.agreement,
                    jpeg=jpeg.data,
                    width=jpeg.width,
                    height=jpeg.height,
                    source_width=int(d.image.shape[1]),
                    source_height=int(d.image.shape[0]),
                    serving=bounded_prediction(d.serving),
                    candidate=bounded_prediction(d.candidate),
                    note=d.note,
                )
            )
        evidence = JobEvidence(job_id, slot, reason, serving_model, candidate_model, frames)
        with self._lock:
            self._jobs.pop(job_id, None)
            self._jobs[job_id] = evidence
            while len(self._jobs) > b.jobs:
                self._jobs.popitem(last=False)
        return evidence.summary()

    def get(self, job_id: str) -> JobEvidence | None:
        with self._lock:
            return self._jobs.get(job_id)

    def held_bytes(self) -> int:
        """JPEG bytes held now (never above ``bounds.max_bytes``)."""
        with self._lock:
            return sum(len(f.jpeg) for e in self._jobs.values() for f in e.frames)


class EvidenceCommand:
    """The ``evidence`` handler: a job's index, or one frame with its JPEG and both outputs."""

    def __init__(self, store: EvidenceStore, payload_limit: Callable[[], int]) -> None:
        self.store = store
        self._payload_limit = payload_limit

    def __call__(self, args: EvidenceArgs) -> dict[str, Any]:
        evidence = self.store.get(args.job_id)
        if evidence is None:
            raise NoEvidenceError(
                f"no evidence kept for job {args.job_id!r} on this device: kept only for jobs a shadow "
                f"run rejected or a probation rolled back unhealthy, the last {self.store.bounds.jobs}, "
                "until the agent restarts"
            )
        if args.frame is None:
            return evidence.index()
        if args.frame >= len(evidence.frames):
            raise NoSuchFrameError(
                f"job {args.job_id!r} has {len(evidence.frames)} evidence frames "
                f"(0..{len(evidence.frames) - 1}); no frame {args.frame}"
            )
        frame = evidence.frames[args.frame]
        result: dict[str, Any] = {
            "job_id": evidence.job_id,
            **frame.meta(args.frame),
            "serving": frame.serving,
            "candidate": frame.candidate,
        }
        rest = len(encode(CommandReply(command="evidence", ok=True, result=result))) + _REPLY_SLACK
        budget = (self._payload_limit() - rest) * 3 // 4
        jpeg, width, height = frame.jpeg, frame.width, frame.height
        if len(jpeg) > budget:
            # The link's limit is below what the store encoded for: re-encode this reply smaller.
            image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
            if budget <= 0 or image is None:
                raise SnapshotTooLargeError(
                    f"an evidence frame does not fit the {self._payload_limit()} bytes an MQTT reply may "
                    "carry: raise mqtt.max_payload_bytes"
                )
            quality = self.store.bounds.quality
            smaller = encode_jpeg(image.astype(np.uint8), max(width, height), budget, quality)
            jpeg, width, height = smaller.data, smaller.width, smaller.height
        result.update(width=width, height=height, bytes=len(jpeg))
        result["jpeg_base64"] = base64.b64encode(jpeg).decode("ascii")
        return result


def _score(value: float) -> float:
    """A score to sort by: NaN or Inf (a broken model's) sorts last."""
    return value if math.isfinite(value) else float("-inf")
