"""The shadow comparison's pure functions: agreement per postprocess kind and the tally's decision."""

from __future__ import annotations

import pytest

from agent.protocol.results import ClassScore, Detection, Prediction, RawTensor
from agent.runtime.slots.agreement import (
    ShadowBar,
    ShadowTally,
    cosine_similarity,
    detection_f1,
    frame_agreement,
    iou,
    top1_agrees,
    topk_overlap,
    total_variation,
)


def cls(*pairs: tuple[int, float]) -> list[ClassScore]:
    return [ClassScore(index=i, label=f"c{i}", score=s) for i, s in pairs]


def det(index: int, box: tuple[float, float, float, float], score: float = 0.9) -> Detection:
    return Detection(index=index, label=f"c{index}", score=score, box=box)


def test_top1_agreement_compares_the_best_class_whatever_the_order() -> None:
    assert top1_agrees(cls((2, 0.9), (1, 0.1)), cls((1, 0.2), (2, 0.7))) == 1.0
    assert top1_agrees(cls((2, 0.9), (1, 0.1)), cls((1, 0.8), (2, 0.2))) == 0.0


def test_top1_agreement_with_empty_sides() -> None:
    assert top1_agrees([], []) == 1.0
    assert top1_agrees(cls((0, 1.0)), []) == 0.0


def test_top5_overlap_counts_shared_classes() -> None:
    old = cls((0, 0.5), (1, 0.2), (2, 0.1), (3, 0.1), (4, 0.1), (5, 0.0))
    new = cls((0, 0.5), (1, 0.2), (2, 0.1), (7, 0.1), (8, 0.1))
    assert topk_overlap(old, new) == pytest.approx(3 / 5)
    assert topk_overlap([], []) == 1.0


def test_iou_of_identical_disjoint_and_half_overlapping_boxes() -> None:
    assert iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)
    assert iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0


def test_detection_f1_no_boxes_on_either_side_is_full_agreement() -> None:
    assert detection_f1([], []) == 1.0


def test_detection_f1_boxes_on_one_side_only_is_no_agreement() -> None:
    assert detection_f1([det(0, (0, 0, 10, 10))], []) == 0.0
    assert detection_f1([], [det(0, (0, 0, 10, 10))]) == 0.0


def test_detection_f1_matches_by_class_at_iou_half() -> None:
    old = [det(0, (0, 0, 10, 10)), det(1, (50, 50, 60, 60))]
    assert detection_f1(old, [det(0, (1, 1, 10, 10)), det(1, (50, 50, 61, 60))]) == 1.0
    # Same place, other class: no match.
    assert detection_f1(old, [det(1, (0, 0, 10, 10)), det(0, (50, 50, 60, 60))]) == 0.0
    # One of two found, one extra: precision 1/2, recall 1/2.
    assert detection_f1(old, [det(0, (0, 0, 10, 10)), det(0, (200, 200, 210, 210))]) == pytest.approx(0.5)
    # IoU just under 0.5 does not match.
    assert detection_f1([det(0, (0, 0, 10, 10))], [det(0, (5, 0, 15, 10))]) == 0.0


def test_detection_f1_matches_each_reference_box_once() -> None:
    old = [det(0, (0, 0, 10, 10))]
    new = [det(0, (0, 0, 10, 10), 0.9), det(0, (0, 0, 10, 10), 0.8)]
    assert detection_f1(old, new) == pytest.approx(2 * 0.5 * 1.0 / 1.5)


def test_cosine_similarity_edge_cases() -> None:
    assert cosine_similarity([1.0, 2.0], [2.0, 4.0]) == pytest.approx(1.0)
    assert cosine_similarity([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert cosine_similarity([1.0, 0.0], [-1.0, 0.0]) == 0.0  # opposite: clipped, not negative
    assert cosine_similarity([0.0, 0.0], [0.0, 0.0]) == 1.0
    assert cosine_similarity([0.0, 0.0], [1.0, 0.0]) == 0.0
    assert cosine_similarity([1.0], [1.0, 2.0]) == 0.0  # changed layout
    assert cosine_similarity([float("nan")], [1.0]) == 0.0


def test_frame_agreement_dispatches_on_the_serving_models_kind() -> None:
    assert frame_agreement(Prediction(classes=cls((1, 0.9))), Prediction(classes=cls((1, 0.8)))) == 1.0
    assert frame_agreement(Prediction(detections=[]), Prediction(detections=[])) == 1.0
    old = Prediction(tensors=[RawTensor(name="y", shape=[2], values=[1.0, 0.0])])
    new = Prediction(tensors=[RawTensor(name="y", shape=[2], values=[0.0, 1.0])])
    assert frame_agreement(old, new) == 0.0


def test_total_variation_distance() -> None:
    assert total_variation({0: 5, 1: 5}, {0: 50, 1: 50}) == 0.0
    assert total_variation({0: 10}, {1: 10}) == 1.0
    assert total_variation({0: 3, 1: 1}, {0: 1, 1: 3}) == pytest.approx(0.5)
    assert total_variation({}, {0: 1}) is None


def tally(frames: int = 10, min_agreement: float | None = 0.8, ratio: float = 2.0) -> ShadowTally:
    return ShadowTally(ShadowBar(frames=frames, min_agreement=min_agreement, max_latency_ratio=ratio))


def test_tally_stops_early_once_the_bar_is_out_of_reach() -> None:
    t = tally()
    for _ in range(2):
        t.add(0.0, 1.0, 1.0)
    assert t.verdict() is None  # 8 of 10 could still agree
    t.add(0.0, 1.0, 1.0)
    assert t.verdict() == "shadow_disagrees"
    assert t.figures()["frames"] == 3


def test_tally_passes_early_once_enough_frames_agree() -> None:
    t = tally()
    for _ in range(7):
        t.add(1.0, 1.0, 1.1)
    assert t.verdict() is None
    t.add(1.0, 1.0, 1.1)  # 8 of 10 agree whatever the last two say
    assert t.verdict() == "pass"


def test_tally_too_slow_on_the_median_latency_ratio() -> None:
    t = tally(frames=4)
    for old, new in ((1.0, 3.0), (1.0, 3.2), (2.0, 2.0), (1.0, 3.1)):
        t.add(1.0, old, new)
    assert t.latency_ratio == pytest.approx(3.05 / 1.0)
    assert t.verdict() == "too_slow"


def test_tally_without_an_agreement_bar_judges_latency_and_output_only() -> None:
    t = tally(frames=3, min_agreement=None)
    for _ in range(3):
        t.add(0.0, 1.0, 1.0)
    assert t.verdict() == "pass"
    t.bad_outputs = 1
    assert t.verdict() == "bad_output"


def test_tally_at_the_timeout_judges_what_it_saw() -> None:
    t = tally(frames=10)
    assert t.verdict(final=True) is None  # nothing compared: no decision to make from it
    for _ in range(3):
        t.add(1.0, 1.0, 1.0)
    assert t.verdict() is None
    assert t.verdict(final=True) == "pass"
