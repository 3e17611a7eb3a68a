"""Boxes from YOLOv5 / YOLOv8 style outputs: decode, confidence filter, class-wise NMS, frame mapping.

YOLOv5 rows are ``cx, cy, w, h, objectness, class scores...`` (``[n, 5+c]``); YOLOv8 columns are
``cx, cy, w, h, class scores...`` (``[4+c, n]``). Box coordinates are model-input pixels.
Everything is vectorised over candidates; the NMS loop runs once per *kept* box and stops at
``max_detections``, so its cost does not grow with the thousands of raw candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.camera.preprocess import Letterbox, boxes_to_source
from agent.errors import EngineError
from agent.model_contract.outputs import MIN_CHANNELS
from agent.postprocess.labels import label_of
from agent.postprocess.tensors import pick_output
from agent.protocol.results import Detection, Prediction
from agent.specs.postprocess import DetectionSpec

log = structlog.get_logger(__name__)

#: Candidates kept for NMS after the confidence filter (highest scores first), as YOLOv5 does.
MAX_CANDIDATES = 30_000


def decode(
    array: npt.NDArray[Any], fmt: str, conf_threshold: float
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.intp]]:
    """Boxes (``x1, y1, x2, y2`` model pixels), scores and class indices of candidates above the threshold.

    ``array`` is one item's output; a leading batch axis of 1 is accepted and dropped.
    """
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    minimum = MIN_CHANNELS[fmt]
    if array.ndim != 2 or array.shape[0 if fmt == "yolov8" else 1] < minimum:
        raise EngineError(f"{fmt} detection output has shape {list(array.shape)}; check postprocess.format")
    if fmt == "yolov8":
        class_scores = array[4:]  # (c, n): reductions along axis 0 read contiguous rows
        best = class_scores.max(axis=0)
        keep = np.flatnonzero(best >= conf_threshold)
        classes = class_scores[:, keep].argmax(axis=0)
        scores = best[keep]
        cxcywh = array[:4, keep].T
    else:
        # Class scores are <= 1, so objectness alone already rules most rows out (YOLOv5 does this too).
        rows = array[np.flatnonzero(array[:, 4] >= conf_threshold)]
        combined = rows[:, 5:] * rows[:, 4:5]
        classes = combined.argmax(axis=1)
        scores = combined[np.arange(classes.size), classes]
        keep = np.flatnonzero(scores >= conf_threshold)
        classes, scores, cxcywh = classes[keep], scores[keep], rows[keep, :4]
    boxes = np.empty((scores.size, 4), dtype=np.float32)
    half = cxcywh[:, 2:4] * 0.5
    boxes[:, :2] = cxcywh[:, :2] - half
    boxes[:, 2:] = cxcywh[:, :2] + half
    return boxes, scores.astype(np.float32, copy=False), classes.astype(np.intp, copy=False)


def _iou(
    a: npt.NDArray[np.float64],
    area_a: npt.NDArray[np.float64],
    b: npt.NDArray[np.float64],
    area_b: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """IoU matrix ``(len(a), len(b))`` of ``x1, y1, x2, y2`` boxes."""
    inter_w = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])
    inter_h = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])
    inter = np.clip(inter_w, 0.0, None) * np.clip(inter_h, 0.0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    iou: npt.NDArray[np.float64] = inter / np.maximum(union, 1e-12)
    return iou


def nms(
    boxes: npt.NDArray[Any], scores: npt.NDArray[Any], iou_threshold: float, limit: int, *, chunk: int = 0
) -> npt.NDArray[np.intp]:
    """Greedy NMS: indices of kept boxes, best score first (ties: lower index first), at most ``limit``.

    Candidates are taken in score-ordered chunks (default ``max(4 * limit, 256)``): a candidate's
    fate depends only on better ones, so each chunk is first cleared against the boxes already
    kept (one matrix), then reduced greedily. With thousands of candidates the greedy loop thus
    runs over a chunk, not over all of them, and stops once ``limit`` boxes are kept.
    """
    order = np.argsort(-scores, kind="stable")
    coords = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    areas = np.clip(coords[:, 2] - coords[:, 0], 0.0, None) * np.clip(coords[:, 3] - coords[:, 1], 0.0, None)
    step = chunk if chunk > 0 else max(4 * limit, 256)
    kept: list[int] = []
    for start in range(0, order.size, step):
        if len(kept) >= limit:
            break
        block = order[start : start + step]
        if kept:
            previous = np.asarray(kept)
            clear = (
                _iou(coords[previous], areas[previous], coords[block], areas[block]) <= iou_threshold
            ).all(axis=0)
            block = block[clear]
        while block.size and len(kept) < limit:
            best, block = block[0], block[1:]
            kept.append(int(best))
            iou = _iou(coords[best : best + 1], areas[best : best + 1], coords[block], areas[block])[0]
            block = block[iou <= iou_threshold]
    return np.asarray(kept, dtype=np.intp)


def class_wise_nms(
    boxes: npt.NDArray[Any],
    scores: npt.NDArray[Any],
    classes: npt.NDArray[Any],
    iou_threshold: float,
    limit: int,
) -> npt.NDArray[np.intp]:
    """NMS within each class: boxes are shifted by ``class * span`` so different classes never overlap."""
    if scores.size == 0:
        return np.empty(0, dtype=np.intp)
    coords = np.asarray(boxes, dtype=np.float64)
    span = float(coords.max() - coords.min()) + 1.0
    shifted = coords + (np.asarray(classes, dtype=np.float64) * span)[:, None]
    return nms(shifted, scores, iou_threshold, limit)


class DetectionPostprocess:
    """List of :class:`Detection` in frame pixels per frame."""

    def __init__(self, spec: DetectionSpec, labels: Sequence[str]) -> None:
        self.spec = spec
        self.labels = list(labels)

    def __call__(self, outputs: Mapping[str, npt.NDArray[Any]], lb: Letterbox) -> Prediction:
        spec = self.spec
        boxes, scores, classes = decode(
            pick_output(outputs, spec.output_name), spec.format, spec.conf_threshold
        )
        if scores.size > MAX_CANDIDATES:
            top = np.argpartition(-scores, MAX_CANDIDATES - 1)[:MAX_CANDIDATES]
            boxes, scores, classes = boxes[top], scores[top], classes[top]
        kept = class_wise_nms(boxes, scores, classes, spec.iou_threshold, spec.max_detections)
        frame_boxes = boxes_to_source(boxes[kept], lb).tolist()
        return Prediction(
            detections=[
                Detection(
                    index=int(c),
                    label=label_of(self.labels, int(c)),
                    score=float(s),
                    box=(b[0], b[1], b[2], b[3]),
                )
                for c, s, b in zip(classes[kept].tolist(), scores[kept].tolist(), frame_boxes, strict=True)
            ]
        )
