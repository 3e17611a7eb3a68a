"""End to end: a new model proves itself on a running daemon (shadow, probation, swap back, restart).

Real mosquitto, real ``python -m agent run`` processes on a real video, models deployed with the
real FleetDeploy (signed, pulled in chunks); the bad models come from tests/runtime/models.py.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.fleet.devices.command import send_command
from agent.protocol.messages import InfoMessage, JobState, JobStatus, decode
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.protocol.topics import Topics
from tests.e2e.fleet_rig import (
    Fleet,
    assert_no_gap,
    count_version,
    final_status,
    finish,
    job_statuses,
    operator_settings,
    results,
)
from tests.mqtt_probe import Probe, Received
from tests.runtime.models import write_nan_when_bright, write_slower, write_swapped_classes
from tests.waiting import patient

pytestmark = pytest.mark.slow


def test_a_model_with_swapped_classes_ends_rejected_in_shadow_and_never_serves(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
) -> None:
    files, daemon, topic = fleet.serving_v1(device_id, probe)
    swapped = write_swapped_classes(files.v1, files.root / "swapped.onnx")

    job = fleet.deploy(swapped, [device_id], "2", shadow=ShadowSpec(frames=20, sample_fps=10.0))
    outcome = finish(job)

    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "shadow_disagrees"), progress
    assert JobState.SHADOW in progress.history
    final = final_status(probe, job.job_id, device_id)
    assert final.shadow is not None
    assert final.shadow.agreement == 0.0
    assert final.shadow.frames >= 1
    time.sleep(1.0)
    found = results(probe.snapshot(), topic.results("cam"))
    assert {r["model"]["version"] for r in found} == {"1"}
    assert daemon.stop() == 0


def test_a_model_several_times_slower_ends_rejected_too_slow_in_shadow_and_never_serves(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
) -> None:
    """Same answers (agreement 1.0), several times the inference time: the latency bar refuses it."""
    files, daemon, topic = fleet.serving_v1(device_id, probe)
    slow = write_slower(files.v1, files.root / "slow.onnx", dim=256, repeats=8)

    job = fleet.deploy(
        slow, [device_id], "2", shadow=ShadowSpec(frames=20, sample_fps=10.0, max_latency_ratio=2.0)
    )
    outcome = finish(job)

    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "too_slow"), progress
    final = final_status(probe, job.job_id, device_id)
    assert final.shadow is not None
    assert final.shadow.latency_ratio is not None
    assert final.shadow.latency_ratio > 2.0
    assert final.shadow.agreement == 1.0  # right answers, too late
    time.sleep(1.0)
    found = results(probe.snapshot(), topic.results("cam"))
    assert {r["model"]["version"] for r in found} == {"1"}
    indices = sorted(int(r["frame_index"]) for r in found)
    assert len(indices) == len(set(indices))
    assert daemon.stop() == 0


@pytest.fixture
def dark_then_bright(tmp_path: Path) -> Path:
    """20 s of dark frames, then 10 s of bright ones, at 30 fps (the late-NaN model's trigger)."""
    path = tmp_path / "dark-then-bright.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 30.0, (64, 48))
    for i in range(900):
        writer.write(np.full((48, 64, 3), 40 if i < 600 else 220, np.uint8))
    writer.release()
    return path


def test_a_model_that_turns_nan_after_n_frames_is_rolled_back_in_probation_without_losing_a_frame(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
    dark_then_bright: Path,
) -> None:
    files = fleet.files(device_id)
    source = {"type": "file", "path": str(dark_then_bright), "loop": False, "realtime": True}
    trust = {"trusted_keys": {fleet.keys.key_id: str(fleet.keys.public)}}
    files.write_config(stream={"source": source}, delivery=trust)
    daemon = fleet.start(files)
    topic = Topics("fleet/v1", device_id)
    probe.wait_for(count_version("1", topic.results("cam")), timeout=60)
    late_nan = write_nan_when_bright(files.v1, files.root / "late-nan.onnx")

    job = fleet.deploy(
        late_nan, [device_id], "2", probation_s=60.0, probation=ProbationSpec(max_class_shift=None)
    )
    outcome = finish(job, timeout=90.0)

    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.ROLLED_BACK, "unhealthy"), progress
    final = final_status(probe, job.job_id, device_id)
    assert final.probation is not None
    assert final.probation.failed is not None
    assert (final.probation.failed.figure, final.probation.failed.bar) == ("nan_outputs", 0)
    probe.wait_for(lambda ms: len(results(ms, topic.results("cam"))) >= 900, timeout=30)
    found = results(probe.snapshot(), topic.results("cam"))
    assert_no_gap(found)
    assert [r["frame_index"] for r in found] == list(range(900))
    assert {r["model"]["version"] for r in found} == {"1", "2"}
    after = [r for r in found if r["published_at"] > final.ts]
    assert after
    assert {r["model"]["version"] for r in after} == {"1"}
    assert daemon.stop() == 0


def test_a_restart_in_shadow_comes_back_on_the_old_model_and_resumes_the_job_into_shadow(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
) -> None:
    """kill -9 while the candidate is in SHADOW: nothing was committed, so the restart serves the old
    model, and the retained manifest resumes the job (QUEUED again, as documented) into SHADOW."""
    files, daemon, topic = fleet.serving_v1(device_id, probe)
    # 30 frames at 1 fps with a 0.9 bar: the tally cannot be sure before ~27 s, so it is still running.
    shadow = ShadowSpec(frames=30, sample_fps=1.0, min_agreement=0.9, timeout_s=120.0)
    job = fleet.deploy(files.v2, [device_id], "2", shadow=shadow)

    def in_shadow(messages: list[Received]) -> bool:
        return any(
            m.topic == topic.jobs(job.job_id) and decode(JobStatus, m.payload).state is JobState.SHADOW
            for m in messages
        )

    probe.wait_for(in_shadow, timeout=60)
    daemon.signal(signal.SIGKILL)
    daemon.proc.wait(patient(10))
    job.stop()
    # A status of the killed run may still be in its spool and be replayed after the restart (same
    # msg_id): consumers drop it by msg_id, and so does this test.
    before = {s.msg_id for s in job_statuses(probe, job.job_id, device_id)}

    def new_statuses() -> list[JobStatus]:
        return [s for s in job_statuses(probe, job.job_id, device_id) if s.msg_id not in before]

    state = json.loads((files.root / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["version"] == "1"  # nothing committed during shadow

    probe.clear()
    daemon = fleet.start(files)
    probe.wait_for(lambda ms: bool(results(ms, topic.results("cam"))), timeout=60)
    first = results(probe.snapshot(), topic.results("cam"))[0]
    assert first["model"]["version"] == "1"  # back on the last-known-good model
    # The retained manifest resumed the job into SHADOW.
    probe.wait_for(lambda _m: any(s.state is JobState.SHADOW for s in new_statuses()), timeout=60)
    resumed = [s.state for s in new_statuses()]
    assert resumed[0] is JobState.QUEUED
    assert not any(s.terminal for s in resumed)
    assert {r["model"]["version"] for r in results(probe.snapshot(), topic.results("cam"))} == {"1"}
    assert daemon.stop() == 0


def test_a_restart_in_probation_comes_back_on_the_old_model_and_a_rollback_command_ends_the_resumed_job(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
) -> None:
    files, daemon, topic = fleet.serving_v1(device_id, probe)
    job = fleet.deploy(
        files.v2, [device_id], "2", probation_s=120.0, probation=ProbationSpec(max_class_shift=None)
    )

    def in_probation(messages: list[Received]) -> bool:
        return any(
            m.topic == topic.jobs(job.job_id) and decode(JobStatus, m.payload).state is JobState.PROBATION
            for m in messages
        )

    probe.wait_for(in_probation, timeout=60)
    probe.wait_for(count_version("2", topic.results("cam")), timeout=30)

    def probation_telemetry(messages: list[Received]) -> bool:
        for m in messages:
            if m.topic == topic.telemetry:
                values = json.loads(m.payload)
                if (
                    values.get("slot.cls.probation.active") == 1
                    and "slot.cls.probation.current.fps.cam" in values
                ):
                    return "slot.cls.probation.baseline.fps.cam" in values
        return False

    probe.wait_for(probation_telemetry, timeout=30)  # a dashboard sees the probation and its figures

    def info_shows_the_candidate_in_probation(messages: list[Received]) -> bool:
        # Issue 22.10: the retained up/info (what `fleet status` and the console read) names the
        # running job in its phase and the candidate that serves, as the results do.
        for m in messages:
            if m.topic == topic.info:
                slot = decode(InfoMessage, m.payload).slots["cls"]
                if slot.last_job == job.job_id and slot.last_job_state is JobState.PROBATION:
                    return slot.model is not None and slot.model.version == "2"
        return False

    probe.wait_for(info_shows_the_candidate_in_probation, timeout=30)
    daemon.signal(signal.SIGKILL)
    daemon.proc.wait(patient(10))
    state = json.loads((files.root / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["version"] == "1"  # never committed during probation

    probe.clear()
    daemon = fleet.start(files)
    # The retained manifest resumes the job at once, so the old model may serve only a few frames.
    probe.wait_for(lambda ms: bool(results(ms, topic.results("cam"))), timeout=60)
    first = results(probe.snapshot(), topic.results("cam"))[0]
    assert first["model"]["version"] == "1"  # back on the last-known-good model
    probe.wait_for(in_probation, timeout=60)  # the retained manifest resumed the job

    reply = send_command(operator_settings(fleet.broker), device_id, "rollback", {"slot": "cls"}, timeout=20)
    assert reply.ok, reply
    assert reply.result is not None
    assert reply.result["model"]["version"] == "1"
    outcome = finish(job, timeout=30.0)
    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.ROLLED_BACK, "operator_rollback"), progress
    state = json.loads((files.root / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["version"] == "1"
    assert daemon.stop() == 0
