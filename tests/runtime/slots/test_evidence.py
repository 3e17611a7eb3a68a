"""Evidence of a shadow rejection: the kept frames, their bounds, and the ``evidence`` command.

Real parts: a slot pipeline on a synthetic source, ONNX Runtime, a real class-swapped model
(tests/runtime/models.py), OpenCV's JPEG codec. No fakes.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.camera.source_spec import FileSourceSpec
from agent.delivery.jobs.steps import GuardReporter
from agent.protocol.command_args import EvidenceArgs
from agent.protocol.delivery_errors import RolledBackError, ShadowRejectedError
from agent.protocol.messages import EvidenceSummary, JobState, ProbationFigures, ShadowFigures
from agent.protocol.proving import ShadowSpec
from agent.protocol.results import ClassScore, Prediction
from agent.runtime.slots.evidence import (
    DisagreementHeap,
    EvidenceBounds,
    EvidenceCommand,
    EvidenceStore,
    NoEvidenceError,
    NoSuchFrameError,
)
from agent.runtime.slots.guarded import GuardedSlot, activate_guarded
from tests.camera.specs import make
from tests.runtime.frames.test_pipeline import Rig, rig, synthetic  # noqa: F401 (rig: a fixture)
from tests.runtime.slots.test_guarded import (  # noqa: F401 (models, brightening_video: fixtures)
    JobSide,
    Target,
    brightening_video,
    models,
    request,
    start,
)


def _image(value: int, size: tuple[int, int] = (48, 64)) -> np.ndarray:
    rng = np.random.default_rng(value)
    return rng.integers(0, 256, (*size, 3), dtype=np.uint8)


def _classes(best: int) -> Prediction:
    return Prediction(
        classes=[ClassScore(index=i, label=f"c{i}", score=0.9 if i == best else 0.01) for i in range(8)]
    )


def test_the_heap_keeps_the_k_lowest_agreements_by_reference_not_copy() -> None:
    heap = DisagreementHeap(3)
    images = [_image(i) for i in range(6)]
    agreements = [0.9, 0.1, 0.5, 0.0, 0.7, 0.3]
    kept = [heap.offer(a, img, _classes(0), _classes(1)) for a, img in zip(agreements, images, strict=True)]
    assert kept == [True, True, True, True, False, True]  # 0.7 is above the three lowest by then
    worst = heap.worst_first()
    assert [d.agreement for d in worst] == [0.0, 0.1, 0.3]
    assert worst[0].image is images[3]  # the capture's array itself: nothing was copied
    assert len(heap) == 3


def test_the_store_keeps_the_last_jobs_each_frame_within_its_byte_budget() -> None:
    bounds = EvidenceBounds(frames=2, jobs=2, max_dimension=32, frame_bytes=1500, quality=90)
    store = EvidenceStore(bounds)
    for job in ("a", "b", "c"):
        heap = store.heap()
        for i in range(4):
            heap.offer(i / 10, _image(i, (480, 640)), _classes(0), _classes(1))
        summary = store.keep(
            job, slot="s", reason="shadow_disagrees", serving_model="m 1", candidate_model="m 2", heap=heap
        )
        assert summary.frames == 2
        assert summary.bytes <= 2 * 1500
    assert store.get("a") is None  # the oldest job was dropped
    kept = store.get("c")
    assert kept is not None
    assert all(len(f.jpeg) <= 1500 and max(f.width, f.height) <= 32 for f in kept.frames)
    assert (kept.frames[0].source_width, kept.frames[0].source_height) == (640, 480)
    # Only the top classes of each output are kept.
    assert len(kept.frames[0].serving["classes"]) == 5
    assert store.held_bytes() <= bounds.max_bytes


def test_the_command_answers_an_index_then_each_frame_within_the_payload_limit() -> None:
    store = EvidenceStore(EvidenceBounds(frames=3, max_dimension=640, frame_bytes=200_000, quality=95))
    heap = store.heap()
    for i in range(3):
        heap.offer(0.0, _image(i, (480, 640)), _classes(0), _classes(2))
    store.keep(
        "job-1", slot="s", reason="shadow_disagrees", serving_model="m 1", candidate_model="m 2", heap=heap
    )
    limit = 40_000  # below a noisy 640x480 JPEG at quality 95: the reply must re-encode smaller
    command = EvidenceCommand(store, lambda: limit)
    index = command(EvidenceArgs(job_id="job-1"))
    assert [f["frame"] for f in index["frames"]] == [0, 1, 2]
    assert index["reason"] == "shadow_disagrees"
    assert "jpeg_base64" not in str(index)
    frame = command(EvidenceArgs(job_id="job-1", frame=1))
    assert len(frame["jpeg_base64"]) < limit
    jpeg = base64.b64decode(frame["jpeg_base64"])
    decoded = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert decoded is not None
    assert decoded.shape[1] == frame["width"]
    assert frame["serving"]["classes"][0]["index"] == 0
    assert frame["candidate"]["classes"][0]["index"] == 2
    with pytest.raises(NoSuchFrameError, match="no frame 3"):
        command(EvidenceArgs(job_id="job-1", frame=3))
    with pytest.raises(NoEvidenceError, match="job-2"):
        command(EvidenceArgs(job_id="job-2"))


@dataclass
class EvidenceSide:
    summaries: list[EvidenceSummary] = field(default_factory=list)
    states: list[JobState] = field(default_factory=list)

    def reporter(self, job_id: str) -> GuardReporter:
        return GuardReporter(
            self.states.append,
            self._figures,
            threading.Event(),
            job_id=job_id,
            evidence=self.summaries.append,
        )

    def _figures(self, shadow: ShadowFigures | None, probation: ProbationFigures | None) -> None:
        pass


def _guarded(target: Target, store: EvidenceStore) -> GuardedSlot:
    """The rig's slot guarded with ``store`` keeping the evidence (nothing recorded, no activation hook)."""
    return GuardedSlot(
        slot=target.slot,
        latest_frame=lambda: target.pipeline.last_image,
        record=lambda _s, _m: None,
        activated=lambda: None,
        runs={},
        evidence=store,
    )


def test_a_class_swapped_candidate_leaves_its_disagreement_frames_with_both_outputs(
    rig: Rig,  # noqa: F811
    models: dict[str, Path],  # noqa: F811
) -> None:
    target = start(rig, models["v1"], synthetic(100_000, fps=30.0))
    store = EvidenceStore(EvidenceBounds(frames=4))
    side = EvidenceSide()
    req, source = request(models["swapped"], shadow=ShadowSpec(frames=20, min_agreement=0.9), job=JobSide())
    req = dataclasses.replace(req, guard=side.reporter("job-swap"))
    guarded = _guarded(target, store)
    with pytest.raises(ShadowRejectedError):
        activate_guarded(guarded, req, source)
    assert len(side.summaries) == 1
    summary = side.summaries[0]
    evidence = store.get("job-swap")
    assert evidence is not None
    assert 1 <= summary.frames <= 4
    assert summary.frames == len(evidence.frames)
    assert summary.bytes == sum(len(f.jpeg) for f in evidence.frames)
    assert evidence.reason == "shadow_disagrees"
    for frame in evidence.frames:
        assert frame.agreement == 0.0
        # The two models name different classes: the swap is visible side by side.
        assert frame.serving["classes"][0]["index"] != frame.candidate["classes"][0]["index"]


def test_a_passing_candidate_keeps_no_evidence(
    rig: Rig,  # noqa: F811
    models: dict[str, Path],  # noqa: F811
) -> None:
    target = start(rig, models["v1"], synthetic(100_000, fps=30.0))
    store = EvidenceStore()
    side = EvidenceSide()
    req, source = request(models["good"], shadow=ShadowSpec(frames=5, min_agreement=0.9), job=JobSide())
    req = dataclasses.replace(req, guard=side.reporter("job-good"))
    guarded = _guarded(target, store)
    activate_guarded(guarded, req, source)
    assert side.summaries == []
    assert store.get("job-good") is None


def test_a_model_rolled_back_for_nan_in_probation_leaves_the_frames_it_failed_on(
    rig: Rig,  # noqa: F811
    models: dict[str, Path],  # noqa: F811
    brightening_video: Path,  # noqa: F811
) -> None:
    target = start(rig, models["v1"], make(FileSourceSpec, path=brightening_video, loop=False, realtime=True))
    store = EvidenceStore(EvidenceBounds(frames=4))
    side = EvidenceSide()
    req, source = request(models["late_nan"], probation_s=30.0, job=JobSide())
    req = dataclasses.replace(req, guard=side.reporter("job-nan"))
    guarded = _guarded(target, store)
    with pytest.raises(RolledBackError):
        activate_guarded(guarded, req, source)
    evidence = store.get("job-nan")

    assert target.slot.current is not None
    assert target.slot.current.ref.version == "1"  # swapped back before the evidence was taken
    assert len(side.summaries) == 1
    assert evidence is not None
    assert evidence.reason == "unhealthy: nan_outputs"
    assert 1 <= len(evidence.frames) <= 4
    # The worst first: a bright frame on which the rejected model gave NaN, the serving one classes.
    worst = evidence.frames[0]
    assert worst.note == "rejected model's outputs NaN or Inf"
    assert worst.agreement == 0.0
    assert worst.serving["classes"]
