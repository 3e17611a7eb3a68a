"""The reconcile decision table."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.delivery.jobs.ledger import JobRecord
from agent.delivery.jobs.reconcile import Action, decide
from agent.protocol.manifest import DeployManifest, build_manifest
from agent.protocol.messages import JobState


@pytest.fixture
def manifest(tmp_path: Path) -> DeployManifest:
    model = tmp_path / "m.bin"
    model.write_bytes(b"x" * 3000)
    return build_manifest(
        model, job_id="job-7", sequence=7, slot="main", model_id="m", version="7", chunk_size=1024
    )


def _record(job_id: str, sequence: int, state: JobState) -> JobRecord:
    return JobRecord(
        job_id=job_id, slot="main", sequence=sequence, sha256="0" * 64, model_id="m", version="x", state=state
    )


@pytest.mark.parametrize(
    ("last", "in_flight", "action"),
    [
        (None, set(), Action.APPLY),
        (("job-6", 6, JobState.ACTIVE), set(), Action.APPLY),
        (("job-6", 6, JobState.DOWNLOADING), {"job-6"}, Action.APPLY),  # newer supersedes a running job
        (("job-7", 7, JobState.ACTIVE), set(), Action.IGNORE),
        (("job-7", 7, JobState.FAILED), set(), Action.IGNORE),  # retried only by a new manifest
        (("job-7", 7, JobState.QUEUED), set(), Action.APPLY),  # interrupted: resume
        (("job-7", 7, JobState.QUEUED), {"job-7"}, Action.IGNORE),  # running now: a repeat
        (("job-8", 8, JobState.ACTIVE), set(), Action.REPLAY),
        (("job-x", 7, JobState.ACTIVE), set(), Action.REPLAY),  # equal sequence, other job id
        # Same id, other sequence: that job id has its states; a REJECTED would be a second end.
        (("job-7", 3, JobState.ACTIVE), set(), Action.IGNORE),
        (("job-7", 3, JobState.DOWNLOADING), set(), Action.IGNORE),
    ],
)
def test_decide(
    manifest: DeployManifest, last: tuple[str, int, JobState] | None, in_flight: set[str], action: Action
) -> None:
    record = _record(*last) if last else None
    decision = decide(manifest, record, in_flight)
    assert decision.action is action, decision.reason
    assert decision.reason


@pytest.mark.parametrize(
    ("last", "action"),
    [
        (("job-8", 8, JobState.ACTIVE), Action.IGNORE),  # an old manifest re-published: not a replay
        (("job-6", 6, JobState.ACTIVE), Action.IGNORE),  # ended, even with a sequence that would win
        (None, Action.IGNORE),
        (("job-7", 7, JobState.QUEUED), Action.APPLY),  # the slot's own interrupted job still resumes
    ],
)
def test_a_job_id_that_ended_is_ignored(
    manifest: DeployManifest, last: tuple[str, int, JobState] | None, action: Action
) -> None:
    record = _record(*last) if last else None
    decision = decide(manifest, record, set(), ended=True)
    assert decision.action is action, decision.reason
    assert decision.reason


@pytest.mark.parametrize(
    ("error_code", "retry", "action"),
    [
        ("disk_full", False, Action.WAIT_FOR_SPACE),  # a reconnect's redelivery does not start a run
        ("disk_full", True, Action.APPLY),  # the service's retry once space is back
        ("build_failed", True, Action.IGNORE),  # only disk_full is retried by the device
    ],
)
def test_a_job_that_failed_disk_full_is_retried_only_by_the_service(
    manifest: DeployManifest, error_code: str, retry: bool, action: Action
) -> None:
    record = _record("job-7", 7, JobState.FAILED).model_copy(update={"error_code": error_code})
    decision = decide(manifest, record, set(), retry=retry)
    assert decision.action is action, decision.reason
