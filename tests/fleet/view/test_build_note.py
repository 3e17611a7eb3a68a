"""The operator side shows a running build: fleet deploy's progress line, fleet watch's lines."""

from __future__ import annotations

import time
from pathlib import Path

from agent.fleet.cli.progress import progress_line
from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.view.build_note import build_note
from agent.fleet.view.watch import read_message, text_line
from agent.protocol.messages import BuildProgressInfo, InfoMessage, JobState, JobStatus, SlotInfo
from agent.protocol.topics import parse

CALIBRATING = BuildProgressInfo(
    phase="calibrating", frames_done=120, frames_total=500, elapsed_s=42.4, estimate_s=310
)


def test_the_note_says_phase_frames_elapsed_and_estimate() -> None:
    assert build_note(CALIBRATING) == "calibrating 120/500 frames, 42 s of ~310 s"
    assert build_note(BuildProgressInfo(phase="building", elapsed_s=3.0)) == "building, 3 s"
    assert build_note(None) == ""


def test_fleet_deploy_shows_the_build_while_building_only() -> None:
    p = DeviceProgress(
        device="cam-01", bytes_total=1000, state=JobState.BUILDING, progress=0.5, build=CALIBRATING
    )
    assert progress_line(p).endswith("  calibrating 120/500 frames, 42 s of ~310 s")
    validating = DeviceProgress(
        device="cam-01", bytes_total=1000, state=JobState.VALIDATING, build=CALIBRATING
    )
    assert "calibrating" not in progress_line(validating)


def test_fleet_watch_shows_a_jobs_build_and_a_slot_serving_while_building() -> None:
    job = JobStatus(job_id="job-1", slot="cls", state=JobState.BUILDING, progress=0.3, build=CALIBRATING)
    seen = read_message(
        parse("fleet/v1/cam-01/up/jobs/job-1", "fleet/v1"), job.model_dump_json().encode(), False
    )
    line = text_line(seen, 0.0)
    assert line is not None
    assert "BUILDING 30% (calibrating 120/500 frames, 42 s of ~310 s)" in line
    building = {"model_id": "cls", "version": "1", "since": 1.0, **CALIBRATING.model_dump()}
    slot = SlotInfo.model_validate({"state": "active", "serving": "interim", "building": building})
    info = InfoMessage(
        device_id="cam-01", agent_version="1", platform={}, backends={}, slots={"cls": slot}, streams=[]
    )
    seen = read_message(parse("fleet/v1/cam-01/up/info", "fleet/v1"), info.model_dump_json().encode(), True)
    line = text_line(seen, 0.0)
    assert line is not None
    assert "slot cls serves its ONNX model while its engine builds" in line
    assert "slot cls building cls: calibrating 120/500 frames" in line


def test_docs_fleet_md_shows_the_lines_these_commands_print() -> None:
    """docs/fleet.md's example lines of a running build are what fleet watch and fleet deploy print."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    at = time.mktime((2026, 1, 1, 12, 0, 4, 0, 0, -1))
    job = JobStatus(job_id="job-8f2c", slot="cls", state=JobState.BUILDING, progress=0.3, build=CALIBRATING)
    job_line = text_line(
        read_message(
            parse("fleet/v1/local-01/up/jobs/job-8f2c", "fleet/v1"), job.model_dump_json().encode(), False
        ),
        at,
    )
    building = {"model_id": "cls", "version": "1", "since": 1.0, "phase": "building", "elapsed_s": 12.0}
    model = {"slot": "cls", "model_id": "cls", "version": "1", "sha256": "a" * 64}
    slot = SlotInfo.model_validate(
        {"state": "active", "serving": "interim", "building": building, "model": model}
    )
    info = InfoMessage(
        device_id="local-01",
        agent_version="0.1.0",
        platform={},
        backends={},
        slots={"cls": slot},
        streams=["cam"],
    )
    info_line = text_line(
        read_message(parse("fleet/v1/local-01/up/info", "fleet/v1"), info.model_dump_json().encode(), True),
        at,
    )
    deploy_line = progress_line(
        DeviceProgress(
            device="local-01", bytes_total=1200000, state=JobState.BUILDING, progress=0.3, build=CALIBRATING
        )
    )
    for line in (f"# {job_line}", f"# {info_line}", deploy_line):
        assert f"\n{line}\n" in doc, line


def test_fleet_status_and_the_console_get_the_slots_serving_and_build() -> None:
    from agent.fleet.view.status import slot_summary

    building = {"model_id": "cls", "version": "1", "since": 1.0, **CALIBRATING.model_dump()}
    slot = SlotInfo.model_validate({"state": "active", "serving": "interim", "building": building})
    info = InfoMessage(
        device_id="cam-01", agent_version="1", platform={}, backends={}, slots={"cls": slot}, streams=[]
    )
    summary = slot_summary(info)["cls"]
    assert (summary["serving"], summary["building"]) == (
        "interim",
        "calibrating 120/500 frames, 42 s of ~310 s",
    )
    idle = SlotInfo.model_validate({"state": "empty"})
    summary = slot_summary(info.model_copy(update={"slots": {"cls": idle}}))["cls"]
    assert (summary["serving"], summary["building"]) == (None, None)


def test_fleet_watch_says_when_a_slot_runs_another_precision_than_asked() -> None:
    runs = {
        "requested": "int8",
        "precision": "fp32",
        "source": "built",
        "fallback": "INT8 accuracy guard: 18.8%",
    }
    slot = SlotInfo.model_validate({"state": "active", "serving": "requested", "runs": runs})
    info = InfoMessage(
        device_id="cam-01", agent_version="1", platform={}, backends={}, slots={"cls": slot}, streams=[]
    )
    seen = read_message(parse("fleet/v1/cam-01/up/info", "fleet/v1"), info.model_dump_json().encode(), True)
    line = text_line(seen, 0.0)
    assert line is not None
    assert "slot cls runs fp32, int8 asked: INT8 accuracy guard: 18.8%" in line
