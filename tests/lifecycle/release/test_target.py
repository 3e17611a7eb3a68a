"""The ``_agent`` target's refusals, its report for ``up/info`` and what it keeps on disk, in process
(tests/lifecycle/release/test_updates.py runs it on real releases)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from agent.delivery.jobs.steps import JobReporter
from agent.lifecycle.health import HealthReading
from agent.lifecycle.release.layout import COMPLETE, CURRENT, GOOD, RELEASE_ENV, PendingUpdate, UpdateOutcome
from agent.lifecycle.release.target import AgentReleaseTarget
from agent.protocol.delivery_errors import AgentIncompatibleError, AgentInstallFailedError
from agent.protocol.manifest import DeployManifest
from tests.lifecycle.release.releases import release_document, write_job

HEALTHY = HealthReading(
    connected=True, streams_flowing=frozenset(), streams=frozenset(), slots_failing=frozenset()
)


def target(state: Path) -> AgentReleaseTarget:
    return AgentReleaseTarget(state, lambda: HEALTHY, restart=lambda: None)


def job(state: Path, tmp_path: Path, version: str = "1.2.0", **fields: object) -> tuple[Path, DeployManifest]:
    wheel = tmp_path / f"edge_agent-{version}-py3-none-any.whl"
    wheel.write_bytes(b"not installed by these tests")
    document = release_document(tmp_path / "release.json", version, [wheel], **fields)
    write_job(state, document, [wheel], job_id="job-7", probation_s=120)
    manifest = DeployManifest.model_validate(json.loads((state / "job.json").read_text())["manifest"])
    return document, manifest


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A device running release 1.0.0 (complete, current and good), as the launcher started it."""
    state = tmp_path / "state"
    (state / "releases" / "1.0.0").mkdir(parents=True)
    (state / "releases" / "1.0.0" / COMPLETE).write_text(json.dumps({"wheels": []}))
    (state / "releases" / CURRENT).symlink_to("1.0.0")
    (state / "releases" / GOOD).symlink_to("1.0.0")
    monkeypatch.setenv(RELEASE_ENV, "1.0.0")
    return state


def test_an_agent_not_started_by_the_launcher_refuses_a_release(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RELEASE_ENV)
    document, manifest = job(state, tmp_path)
    with pytest.raises(AgentIncompatibleError, match="not started by the release launcher"):
        target(state).verify(document, manifest)


def test_a_deadline_shorter_than_the_confirmation_window_is_refused(state: Path, tmp_path: Path) -> None:
    document, manifest = job(state, tmp_path)
    short = manifest.model_copy(update={"probation_s": 30.0})
    with pytest.raises(AgentIncompatibleError, match="probation_s 30 leaves no time"):
        target(state).verify(document, short)


def test_a_manifest_naming_another_version_than_its_document_is_refused(state: Path, tmp_path: Path) -> None:
    document, manifest = job(state, tmp_path)
    with pytest.raises(
        AgentIncompatibleError, match=r"the manifest's version 9\.9 is not the release's 1\.2\.0"
    ):
        target(state).verify(document, manifest.model_copy(update={"version": "9.9"}))


def test_a_document_that_is_no_release_is_refused_naming_the_field(state: Path, tmp_path: Path) -> None:
    document, manifest = job(state, tmp_path)
    document.write_text(json.dumps({"version": "1.2.0", "python": "3.11", "platforms": [], "wheels": []}))
    with pytest.raises(AgentIncompatibleError, match="platforms"):
        target(state).verify(document, manifest)


def test_a_second_release_waits_for_the_one_on_trial(state: Path, tmp_path: Path) -> None:
    document, manifest = job(state, tmp_path)
    releases = target(state).releases
    releases.write_update(
        PendingUpdate(job_id="job-6", previous="1.0.0", candidate="1.1.0", deadline=0, deadline_s=120,
                      confirm_s=60, max_attempts=3)
    )  # fmt: skip
    reporter = JobReporter(lambda fraction: None, threading.Event())
    with pytest.raises(AgentInstallFailedError, match=r"release 1.1.0 \(job job-6\) is still on trial"):
        target(state).install(document, {}, manifest, reporter)
    assert sorted(p.name for p in releases.root.iterdir()) == ["1.0.0", "current", "good", "update.json"]


def test_info_says_what_runs_what_is_on_trial_and_what_was_put_back(state: Path) -> None:
    releases = target(state).releases
    assert target(state).info().model_dump() == {
        "version": "1.0.0", "job_id": None, "pending": None, "reverted": None,
    }  # fmt: skip
    releases.write_outcome(UpdateOutcome("job-5", "1.1.0", "rolled_back", "exited 3 times", "1.0.0"))
    releases.write_update(
        PendingUpdate(job_id="job-6", previous="1.0.0", candidate="1.2.0", deadline=0, deadline_s=120,
                      confirm_s=60, max_attempts=3)
    )  # fmt: skip
    assert target(state).info().model_dump() == {
        "version": "1.0.0", "job_id": None, "pending": "1.2.0", "reverted": "1.1.0: exited 3 times",
    }  # fmt: skip


def test_after_a_confirmation_the_running_release_and_the_one_before_stay(state: Path) -> None:
    releases = target(state).releases
    for version, wheels in (("0.9.0", ["aa" * 32]), ("1.1.0", ["bb" * 32])):
        (releases.root / version).mkdir()
        (releases.root / version / COMPLETE).write_text(json.dumps({"wheels": wheels}))
    for sha in ("aa" * 32, "bb" * 32):
        (releases.root / "wheels" / sha).mkdir(parents=True)
        (releases.root / "wheels" / sha / "x-1-py3-none-any.whl").write_bytes(b"x")
    (releases.root / ".staging-0.9.5").mkdir()
    releases.switch(CURRENT, "1.1.0")
    releases.switch(GOOD, "1.1.0")
    releases.write_outcome(UpdateOutcome("job-5", "1.1.0", "active", None, "1.0.0"))
    target(state).keep_only_what_is_used()
    assert sorted(p.name for p in releases.root.iterdir() if not p.is_symlink()) == [
        "1.0.0", "1.1.0", "outcome.json", "wheels",
    ]  # fmt: skip
    assert [p.name for p in (releases.root / "wheels").iterdir()] == ["bb" * 32]
