"""jobs.json: persisted atomically, survives a restart, a corrupt file is set aside."""

from __future__ import annotations

from pathlib import Path

from agent.delivery.jobs.ledger import ENDED_MAX, JobRecord, JobsFile
from agent.protocol.messages import JobState, JobStatus


def _record(job_id: str, state: JobState, slot: str = "main") -> JobRecord:
    return JobRecord(
        job_id=job_id, slot=slot, sequence=3, sha256="a" * 64, model_id="m", version="3", state=state
    )


def test_record_survives_reload(tmp_path: Path) -> None:
    ledger = JobsFile.in_dir(tmp_path)
    assert ledger.last("main") is None
    ledger.record(_record("job-1", JobState.QUEUED))
    ledger.record(_record("job-1", JobState.ACTIVE))
    ledger.record(_record("job-9", JobState.FAILED, slot="det"))
    reloaded = JobsFile.in_dir(tmp_path)
    main = reloaded.last("main")
    assert main is not None
    assert main.state is JobState.ACTIVE
    assert main.done
    assert set(reloaded.all()) == {"main", "det"}
    assert [p.name for p in tmp_path.iterdir()] == ["jobs.json"]  # no temp file left


def test_corrupt_file_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / "jobs.json").write_text('{"slots": {"main": {"job_id": ')
    ledger = JobsFile.in_dir(tmp_path)
    assert ledger.all() == {}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("jobs.json.corrupt-")]
    ledger.record(_record("job-2", JobState.ACTIVE))
    assert JobsFile.in_dir(tmp_path).last("main") is not None


def test_record_keeps_the_status_it_published_with_its_msg_id(tmp_path: Path) -> None:
    status = JobStatus(job_id="job-1", slot="main", state=JobState.ACTIVE, timings_s={"validate": 0.2})
    ledger = JobsFile.in_dir(tmp_path)
    ledger.record(_record("job-1", JobState.ACTIVE).model_copy(update={"status": status}))
    reloaded = JobsFile.in_dir(tmp_path).last("main")
    assert reloaded is not None
    assert reloaded.status == status  # same msg_id: republished after a restart, it is a duplicate


def test_ended_job_ids_survive_a_restart_and_stay_bounded(tmp_path: Path) -> None:
    ledger = JobsFile.in_dir(tmp_path)
    ledger.record(_record("job-1", JobState.DOWNLOADING))
    assert not ledger.has_ended("job-1")  # running: not ended
    ledger.record(_record("job-1", JobState.ACTIVE))
    ledger.record(_record("job-2", JobState.QUEUED))  # replaces job-1 as the slot's last
    ledger.remember_ended("job-refused")  # a refused manifest never becomes a slot's job
    reloaded = JobsFile.in_dir(tmp_path)
    assert reloaded.has_ended("job-1")
    assert reloaded.has_ended("job-refused")
    assert not reloaded.has_ended("job-2")
    for n in range(ENDED_MAX):
        reloaded.remember_ended(f"job-x{n}")
    assert not JobsFile.in_dir(tmp_path).has_ended("job-1")  # the oldest go first
    assert JobsFile.in_dir(tmp_path).has_ended(f"job-x{ENDED_MAX - 1}")
