"""The launcher's choice at each start, on real directories and links (no process is replaced here:
``choose`` decides, ``main`` execs; tests/lifecycle/release/test_updates.py runs the whole launcher)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.lifecycle.release.launcher import choose
from agent.lifecycle.release.layout import (
    COMPLETE,
    CONFIRMING,
    CURRENT,
    GOOD,
    REVERTING,
    PendingUpdate,
    Releases,
)
from tests.waiting import patient


@pytest.fixture
def releases(tmp_path: Path) -> Releases:
    """Two complete releases (directories with .complete; no environment needed to choose), 1 good."""
    releases = Releases(tmp_path / "releases")
    for version in ("1", "2"):
        (releases.root / version).mkdir(parents=True)
        (releases.root / version / COMPLETE).write_text("{}")
    releases.switch(CURRENT, "1")
    releases.switch(GOOD, "1")
    return releases


def pending(releases: Releases, **changes: object) -> PendingUpdate:
    update = PendingUpdate(
        job_id="job-1", previous="1", candidate="2", deadline=time.time() + 100, deadline_s=100,
        confirm_s=60, max_attempts=3,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(update, key, value)
    releases.write_update(update)
    return update


def test_with_nothing_pending_it_starts_current(releases: Releases) -> None:
    releases.switch(CURRENT, "2")
    assert choose(releases, time.time()) == "2"


def test_a_current_release_that_is_incomplete_gives_way_to_the_good_one(releases: Releases) -> None:
    releases.switch(CURRENT, "2")
    (releases.root / "2" / COMPLETE).unlink()
    assert choose(releases, time.time()) == "1"


def test_a_release_on_trial_is_started_and_its_start_counted(releases: Releases) -> None:
    pending(releases)
    assert choose(releases, time.time()) == "2"
    update = releases.read_update()
    assert update is not None
    assert update.attempts == 1
    assert releases.link(CURRENT) == "2"  # a kill before the switch: the launcher finished it
    assert releases.link(GOOD) == "1"


def test_a_kill_between_the_two_link_writes_leaves_the_old_link_and_a_stray_one(releases: Releases) -> None:
    pending(releases)
    (releases.root / ".current.new").symlink_to("1")  # what a kill after symlink(), before rename, leaves
    assert choose(releases, time.time()) == "2"
    assert releases.link(CURRENT) == "2"
    assert not (releases.root / ".current.new").exists()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"attempts": 3, "started": 0}, "crashed at import: started 3 times and never reached start-up"),
        ({"attempts": 3, "started": 3}, "exited 3 times without being confirmed"),
        ({"attempts": 1, "started": 1, "deadline": 0.0}, "not confirmed within 100 s"),
    ],
    ids=["import", "crash-loop", "deadline"],
)
def test_a_release_out_of_starts_or_time_is_put_back(
    releases: Releases, changes: dict[str, object], reason: str
) -> None:
    pending(releases, **changes)
    assert choose(releases, time.time()) == "1"
    assert releases.link(CURRENT) == releases.link(GOOD) == "1"
    assert releases.read_update() is None
    outcome = releases.read_outcome()
    assert outcome is not None
    assert (outcome.job_id, outcome.version, outcome.outcome, outcome.reason) == (
        "job-1", "2", "rolled_back", reason,
    )  # fmt: skip


def test_a_confirmation_a_kill_interrupted_is_finished(releases: Releases) -> None:
    pending(releases, state=CONFIRMING, attempts=3, started=3)
    releases.switch(CURRENT, "2")
    assert choose(releases, time.time()) == "2"
    assert releases.link(GOOD) == "2"
    outcome = releases.read_outcome()
    assert outcome is not None
    assert outcome.outcome == "active"


def test_a_put_back_a_kill_interrupted_is_finished(releases: Releases) -> None:
    pending(releases, state=REVERTING, reason="exited 3 times without being confirmed")
    releases.switch(CURRENT, "2")
    assert choose(releases, time.time()) == "1"
    assert releases.link(CURRENT) == "1"
    outcome = releases.read_outcome()
    assert outcome is not None
    assert outcome.reason == "exited 3 times without being confirmed"


def test_an_unreadable_update_record_starts_the_good_release(releases: Releases) -> None:
    releases.switch(CURRENT, "2")
    (releases.root / "update.json").write_text(json.dumps(["not", "a", "record"]))
    assert choose(releases, time.time()) == "1"


def test_the_launcher_imports_nothing_but_the_standard_library_and_its_own_modules() -> None:
    """A release whose dependencies are broken must not break the launcher: it imports no pydantic,
    no YAML, nothing a wheel brings."""
    code = (
        "import sys, agent.lifecycle.release.launcher\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names\n"
        "             and not m.startswith('_')))"  # __main__, and the site's own import hooks
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=patient(30), check=True
    )
    assert set(eval(done.stdout)) == {
        "agent", "agent.fsutil", "agent.lifecycle", "agent.lifecycle.release",
        "agent.lifecycle.release.launcher", "agent.lifecycle.release.layout",
    }  # fmt: skip
