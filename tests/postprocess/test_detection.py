"""Detection: YOLOv5/YOLOv8 decode, confidence filter, class-wise NMS, letterbox mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from structlog.testing import capture_logs

from agent.camera.preprocess import Letterbox
from agent.errors import EngineError
from agent.model_contract.tensors import TensorSpec
from agent.postprocess.detection import class_wise_nms, decode, nms
from agent.postprocess.runner import Postprocessor
from agent.specs.postprocess import DetectionSpec

#: One candidate: (cx, cy, w, h, class scores...)
Row = tuple[float, ...]


def _spec(**fields: Any) -> DetectionSpec:
    return DetectionSpec.model_validate({"type": "detection", **fields})


def _v8(rows: Sequence[Row]) -> npt.NDArray[np.float32]:
    """YOLOv8 layout: one column per candidate, ``[4+c, n]``."""
    return np.ascontiguousarray(np.asarray(rows, dtype=np.float32).T)


def _v5(rows: Sequence[Row], objectness: float = 1.0) -> npt.NDArray[np.float32]:
    """YOLOv5 layout ``[n, 5+c]`` with the class scores divided by ``objectness`` (same products)."""
    array = np.asarray(rows, dtype=np.float32)
    obj = np.full((array.shape[0], 1), objectness, dtype=np.float32)
    return np.concatenate([array[:, :4], obj, array[:, 4:] / objectness], axis=1)


def _detect(
    array: npt.NDArray[np.float32], lb: Letterbox, **fields: Any
) -> list[tuple[int, str, float, tuple[float, float, float, float]]]:
    prediction = Postprocessor(_spec(**fields))({"output0": array}, lb)
    assert prediction.detections is not None
    return [(d.index, d.label, d.score, d.box) for d in prediction.detections]


def test_overlapping_same_class_suppressed(identity_lb: Letterbox) -> None:
    rows = [(100, 100, 50, 50, 0.9, 0.0), (104, 102, 50, 50, 0.8, 0.0), (300, 300, 40, 40, 0.7, 0.0)]
    got = _detect(_v8(rows), identity_lb)
    assert [(i, round(s, 3)) for i, _, s, _ in got] == [(0, 0.9), (0, 0.7)]
    assert got[0][3] == pytest.approx((75, 75, 125, 125))


def test_overlapping_different_classes_kept(identity_lb: Letterbox) -> None:
    rows = [(100, 100, 50, 50, 0.9, 0.0), (104, 102, 50, 50, 0.0, 0.8)]
    got = _detect(_v8(rows), identity_lb, labels=["person", "car"])
    assert [(i, label) for i, label, _, _ in got] == [(0, "person"), (1, "car")]


def test_iou_threshold_decides(identity_lb: Letterbox) -> None:
    # Two 100x100 boxes shifted by 50 px: IoU = 5000 / 15000 = 1/3.
    rows = [(100, 100, 100, 100, 0.9), (150, 100, 100, 100, 0.8)]
    assert len(_detect(_v8(rows), identity_lb, iou_threshold=0.3)) == 1
    assert len(_detect(_v8(rows), identity_lb, iou_threshold=0.4)) == 2


def test_confidence_threshold(identity_lb: Letterbox) -> None:
    rows = [(50, 50, 10, 10, 0.5, 0.1), (200, 200, 10, 10, 0.2, 0.24), (400, 400, 10, 10, 0.1, 0.3)]
    got = _detect(_v8(rows), identity_lb, conf_threshold=0.3)
    assert [(i, round(s, 3)) for i, _, s, _ in got] == [(0, 0.5), (1, 0.3)]  # 0.3 itself is kept
    assert _detect(_v8(rows), identity_lb, conf_threshold=0.6) == []


def test_best_class_wins(identity_lb: Letterbox) -> None:
    got = _detect(_v8([(50, 50, 10, 10, 0.3, 0.9, 0.6)]), identity_lb)
    assert [(i, label) for i, label, _, _ in got] == [(1, "class_1")]


def test_yolov5_objectness_multiplies_class_score(identity_lb: Letterbox) -> None:
    v5 = np.array(
        [
            [50, 50, 10, 10, 0.5, 0.9, 0.1],
            [200, 200, 10, 10, 0.2, 1.0, 0.0],
            [300, 300, 10, 10, 0.9, 0.2, 0.5],
        ],
        dtype=np.float32,
    )
    got = _detect(v5, identity_lb, format="yolov5", conf_threshold=0.25)
    assert [(i, round(s, 3)) for i, _, s, _ in got] == [(0, 0.45), (1, 0.45)]


@pytest.mark.parametrize("objectness", [1.0, 0.9])
def test_yolov5_and_yolov8_agree(identity_lb: Letterbox, objectness: float) -> None:
    rng = np.random.default_rng(7)
    n, classes = 300, 4
    centres = rng.uniform(0, 640, (n, 2))
    sizes = rng.uniform(10, 120, (n, 2))
    scores = rng.uniform(0, 0.85, (n, classes))
    rows = [tuple(r) for r in np.concatenate([centres, sizes, scores], axis=1)]
    v8 = _detect(_v8(rows), identity_lb, max_detections=300)
    v5 = _detect(_v5(rows, objectness), identity_lb, format="yolov5", max_detections=300)
    assert len(v8) > 10
    assert [i for i, *_ in v5] == [i for i, *_ in v8]
    np.testing.assert_allclose([b for *_, b in v5], [b for *_, b in v8], atol=1e-3)
    assert [s for *_, s, _ in v5] == pytest.approx([s for *_, s, _ in v8], abs=1e-5)


@pytest.mark.parametrize("fmt", ["yolov8", "yolov5"])
def test_leading_batch_axis_of_one_accepted(identity_lb: Letterbox, fmt: str) -> None:
    rows = [(100, 100, 50, 50, 0.9, 0.0)]
    array = _v8(rows) if fmt == "yolov8" else _v5(rows)
    assert _detect(array[None], identity_lb, format=fmt) == _detect(array, identity_lb, format=fmt)
    assert len(_detect(array[None], identity_lb, format=fmt)) == 1


def test_boxes_mapped_through_letterbox() -> None:
    # A 640x480 frame letterboxed into 320x320: scale 0.5, 40 px bars top and bottom.
    lb = Letterbox(scale_x=0.5, scale_y=0.5, pad_x=0.0, pad_y=40.0, src_width=640, src_height=480)
    rows = [(100, 100, 40, 20, 0.9), (310, 275, 40, 30, 0.8)]
    got = _detect(_v8(rows), lb)
    assert got[0][3] == pytest.approx((160, 100, 240, 140))
    assert got[1][3] == pytest.approx((580, 440, 640, 480))  # clipped at the frame's right/bottom edge


def test_max_detections_keeps_best(identity_lb: Letterbox) -> None:
    rows = [(20 + 30 * i, 50, 10, 10, 0.3 + 0.01 * i) for i in range(20)]
    got = _detect(_v8(rows), identity_lb, max_detections=5)
    assert [round(s, 2) for *_, s, _ in got] == [0.49, 0.48, 0.47, 0.46, 0.45]


def test_no_candidates(identity_lb: Letterbox) -> None:
    assert _detect(np.zeros((7, 0), np.float32), identity_lb) == []
    assert _detect(np.zeros((6, 10), np.float32), identity_lb) == []


def test_many_candidates_bounded(identity_lb: Letterbox) -> None:
    rng = np.random.default_rng(1)
    array = np.concatenate(
        [rng.uniform(0, 640, (2, 8400)), rng.uniform(4, 60, (2, 8400)), rng.uniform(0, 1, (80, 8400))]
    ).astype(np.float32)
    got = _detect(array, identity_lb, conf_threshold=0.25, max_detections=300)
    assert len(got) == 300
    scores = [s for *_, s, _ in got]
    assert scores == sorted(scores, reverse=True)


def _reference_nms(
    boxes: npt.NDArray[Any], scores: npt.NDArray[Any], classes: npt.NDArray[Any], thr: float
) -> list[int]:
    """Plain-Python greedy NMS per class: the definition the vectorised one must match."""

    def iou(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> float:
        w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = w * h
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return float(inter / union)

    kept: list[int] = []
    for i in sorted(range(len(scores)), key=lambda k: (-scores[k], k)):
        if all(classes[i] != classes[j] or iou(boxes[i], boxes[j]) <= thr for j in kept):
            kept.append(i)
    return kept


def test_class_wise_nms_matches_reference() -> None:
    rng = np.random.default_rng(3)
    n = 400
    xy = rng.uniform(0, 300, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(5, 80, (n, 2))], axis=1)
    scores = rng.uniform(0, 1, n).round(2)  # rounding creates ties
    classes = rng.integers(0, 3, n)
    got = class_wise_nms(boxes, scores, classes, 0.45, limit=10_000).tolist()
    assert got == _reference_nms(boxes, scores, classes, 0.45)
    assert class_wise_nms(boxes, scores, classes, 0.45, limit=7).tolist() == got[:7]
    for chunk in (1, 16, 50):  # candidates decided in score-ordered chunks give the same answer
        assert nms_chunked(boxes, scores, classes, chunk, limit=10_000) == got
        assert nms_chunked(boxes, scores, classes, chunk, limit=30) == got[:30]


def nms_chunked(
    boxes: npt.NDArray[Any], scores: npt.NDArray[Any], classes: npt.NDArray[Any], chunk: int, limit: int
) -> list[int]:
    span = float(boxes.max() - boxes.min()) + 1.0
    shifted = boxes + (classes * span)[:, None]
    kept: list[int] = nms(shifted, scores, 0.45, limit, chunk=chunk).tolist()
    return kept


def test_decode_converts_centre_size_to_corners() -> None:
    boxes, scores, classes = decode(_v8([(10, 20, 4, 8, 0.1, 0.7)]), "yolov8", 0.25)
    np.testing.assert_allclose(boxes, [[8, 16, 12, 24]])
    np.testing.assert_allclose(scores, [0.7])
    assert classes.tolist() == [1]


@pytest.mark.parametrize(
    ("fmt", "shape"), [("yolov8", (3, 100)), ("yolov5", (100, 5)), ("yolov8", (1, 2, 7, 100)), ("yolov5", ())]
)
def test_decode_refuses_too_few_channels(fmt: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(EngineError, match=fmt):
        decode(np.zeros(shape, np.float32), fmt, 0.25)


def test_label_count_mismatch_warns() -> None:
    post = Postprocessor(_spec(labels=["a", "b"]))
    with capture_logs() as logs:
        post.validate([TensorSpec("output0", ("batch", 7, 100), "float32")])  # 3 classes
    assert [(e["event"], e["labels"], e["classes"]) for e in logs] == [("postprocess.labels.mismatch", 2, 3)]
    with capture_logs() as logs:
        post.validate([TensorSpec("output0", ("batch", 6, 100), "float32")])
    assert logs == []
