"""Build progress: phase of a progress line, frames, estimate from history, the publication bound."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from agent.engines.building.history import MAX_FINGERPRINTS, PER_FINGERPRINT, BuildHistory, build_fingerprint
from agent.engines.building.progress import (
    PUBLISH_INTERVAL_S,
    ProgressTracker,
    estimate_from,
    estimate_of,
    frames_of,
    phase_of,
)
from agent.engines.cache.key import EngineIdentity

SHA = "a" * 64


def test_progress_lines_map_to_phases() -> None:
    assert phase_of("onnxslim 0.1.40: 120 -> 96 nodes") == "slimming"
    assert phase_of("calibrating (entropy) and quantizing to INT8 Q/DQ for cpu") == "calibrating"
    assert phase_of("calibration: collecting 64 frames of slot cls") == "calibrating"
    assert phase_of("cache miss 0123456789ab: building with tensorrt") == "building"
    assert phase_of("building for dla0") == "building"
    assert phase_of("placement: gpu fastest") == "timing placements"
    assert phase_of("int8 guard: agreement 0.99") == "checking"
    assert phase_of("cache hit 0123456789ab") is None


def test_frames_and_estimate_are_read_from_their_lines() -> None:
    assert frames_of("calibrating 40/500 frames") == (40, 500)
    assert frames_of("calibrating 600/500 frames") == (500, 500)
    assert frames_of("calibrating 1/0 frames") is None
    assert frames_of("building") is None
    assert (
        estimate_of("cache miss abc: building with onnxruntime (estimate 312s from 3 earlier builds)") == 312
    )
    assert estimate_of("cache miss abc: building with onnxruntime") is None


def test_the_estimate_is_the_median_of_earlier_builds() -> None:
    assert estimate_from([]) is None
    assert estimate_from([300.0]) == 300.0
    assert estimate_from([300.0, 310.0, 900.0]) == 310.0  # one slow build does not drag it
    assert estimate_from([300.0, 320.0]) == 310.0


def test_the_tracker_publishes_at_most_once_per_interval_and_keeps_the_newest_state() -> None:
    tracker = ProgressTracker(started=100.0)
    first = tracker.update(
        "cache miss abc: building with onnxruntime (estimate 60s from 2 earlier builds)", 100.0
    )
    assert first is not None
    assert (first.phase, first.estimate_s, first.elapsed_s) == ("building", 60.0, 0.0)
    # Many lines inside one interval: none published, the newest kept.
    for done in range(1, 200):
        assert tracker.update(f"calibrating {done}/500 frames", 100.0 + done * 0.005) is None
    later = tracker.due(100.0 + PUBLISH_INTERVAL_S)
    assert later is not None
    assert later.as_dict() == {
        "phase": "calibrating",
        "frames_done": 199,
        "frames_total": 500,
        "elapsed_s": PUBLISH_INTERVAL_S,
        "estimate_s": 60.0,
    }
    # A new phase drops the frames of the old one.
    assert tracker.update("building for cpu", 100.0 + 2 * PUBLISH_INTERVAL_S) is not None
    assert tracker.state.frames_total is None
    assert tracker.state.phase == "building"


def test_a_calibration_shorter_than_the_interval_is_still_published_with_its_frames() -> None:
    """Collecting 16 frames and calibrating on them within one interval: the next publication
    shows that phase as it ended, the one after the newest; the bound holds throughout."""
    tracker = ProgressTracker(started=100.0)
    assert tracker.update("plan: int8 on cpu", 100.0) is not None
    lines = [f"calibration: collected {n}/16 frames of slot cls" for n in range(2, 17, 2)]
    lines += [f"calibrating {n}/16 frames" for n in (8, 16)]
    lines += ["quantizing to INT8 Q/DQ for cpu"]
    for n, line in enumerate(lines, 1):
        assert tracker.update(line, 100.0 + n * 0.1) is None
    calibrating = tracker.due(100.0 + PUBLISH_INTERVAL_S)
    assert calibrating is not None
    assert (calibrating.phase, calibrating.frames_done, calibrating.frames_total) == ("calibrating", 16, 16)
    assert tracker.shown == calibrating  # up/info shows what was published
    assert tracker.due(100.0 + PUBLISH_INTERVAL_S + 0.5) is None
    newest = tracker.due(100.0 + 2 * PUBLISH_INTERVAL_S)
    assert newest is not None
    assert (newest.phase, newest.frames_total) == ("building", None)
    assert tracker.due(100.0 + 3 * PUBLISH_INTERVAL_S) == replace(newest, elapsed_s=3 * PUBLISH_INTERVAL_S)


def _identity(**versions: str) -> EngineIdentity:
    return EngineIdentity(
        backend="onnxruntime",
        precision="fp32",
        device="cpu",
        model_sha256=SHA,
        backend_version=versions.get("backend_version", "1.19.0"),
        l4t_release=versions.get("l4t_release", "36.3"),
    )


def test_the_fingerprint_survives_an_upgrade_but_not_a_different_model() -> None:
    before = build_fingerprint(_identity())
    assert build_fingerprint(_identity(backend_version="1.20.0", l4t_release="36.4")) == before
    other = _identity().model_copy(update={"model_sha256": "b" * 64})
    assert build_fingerprint(other) != before


def test_history_is_bounded_per_fingerprint_and_in_fingerprints(tmp_path: Path) -> None:
    history = BuildHistory(tmp_path)
    for seconds in range(10):
        history.record("fp", float(seconds))
    assert history.durations("fp") == [5.0, 6.0, 7.0, 8.0, 9.0][-PER_FINGERPRINT:]
    assert history.estimate("fp") == (7.0, PER_FINGERPRINT)
    for n in range(MAX_FINGERPRINTS + 5):
        history.record(f"other-{n}", 1.0)
    stored = json.loads((tmp_path / "build_history.json").read_text())
    assert len(stored) == MAX_FINGERPRINTS
    assert "fp" not in stored  # the least recently built went first
    # A damaged file starts afresh instead of failing the build.
    (tmp_path / "build_history.json").write_text("{not json")
    assert BuildHistory(tmp_path).estimate("other-70") == (None, 0)


def test_an_interim_model_runs_on_the_best_provider_present_never_tensorrt() -> None:
    from agent.backends.onnxruntime import interim_providers

    every = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert interim_providers(every) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert interim_providers(["CPUExecutionProvider"]) == ("CPUExecutionProvider",)
    assert interim_providers([]) == ("CPUExecutionProvider",)
