"""The agent updating itself, on real processes: two real releases built from this repository, installed
with pip offline, started by the launcher under a stand-in for systemd; each case leaves the previous
release running and nothing else touched, or the new one confirmed."""

from __future__ import annotations

import json
import platform
from typing import Any

import pytest

from tests.lifecycle.release.releases import ABSENT, BASE_VERSION, Device, fingerprint, run_update


def assert_previous_runs_untouched(
    device: Device, done: dict[str, object], before: list[tuple[str, int]]
) -> None:
    assert done["release"] == BASE_VERSION
    assert device.link("current") == device.link("good") == BASE_VERSION
    assert not (device.releases / "update.json").exists()
    assert fingerprint(device.releases / BASE_VERSION) == before


def test_a_good_release_is_installed_beside_started_confirmed_and_active(device: Device) -> None:
    device.deliver("1.0.1")
    before = fingerprint(device.releases / BASE_VERSION)
    done, service = run_update(device)
    assert done == {"state": "ACTIVE", "release": "1.0.1"}
    assert device.link("current") == device.link("good") == "1.0.1"
    assert fingerprint(device.releases / BASE_VERSION) == before
    states = [s["state"] for s in service.lines("statuses.jsonl")]
    assert states.count("ACTIVE") == 1
    assert "PROBATION" in states
    info = service.lines("infos.jsonl")[-1]
    assert info["version"] == "1.0.1"
    assert info["job_id"] == "job-1"
    assert info["pending"] is None
    # The new release's wheel is held by hash for the next update; its own agent was really installed.
    [held] = (device.releases / "wheels").iterdir()
    assert (held / device.built.wheels["1.0.1"].name).is_file()
    assert json.loads((device.releases / "1.0.1" / ".complete").read_text())["wheels"] == [held.name]


def test_a_release_that_fails_at_import_is_put_back(device: Device) -> None:
    device.deliver("1.0.2")
    before = fingerprint(device.releases / BASE_VERSION)
    done, service = run_update(device)
    assert done["state"] == "ROLLED_BACK"
    assert done["code"] == "agent_reverted"
    assert "crashed at import" in str(done["error"])
    assert_previous_runs_untouched(device, done, before)
    assert str(service.lines("infos.jsonl")[-1]["reverted"]).startswith("1.0.2: crashed at import")


def test_a_release_that_crashes_after_a_while_is_never_confirmed(device: Device) -> None:
    device.deliver("1.0.3")
    before = fingerprint(device.releases / BASE_VERSION)
    done, service = run_update(device)
    assert done["state"] == "ROLLED_BACK"
    assert done["code"] == "agent_reverted"
    assert "exited 3 times without being confirmed" in str(done["error"])
    assert_previous_runs_untouched(device, done, before)
    # The launcher counted three exits (the error above); on a loaded machine a start can die of its
    # crash timer before it records itself, so the device's own log holds at most those three.
    trials = [s for s in service.lines("starts.jsonl") if s["release"] == "1.0.3"]
    assert 1 <= len(trials) <= 3
    assert all(s["on_trial"] for s in trials)


def test_a_release_never_healthy_is_put_back_at_its_deadline(device: Device) -> None:
    (device.state / "health.json").write_text(json.dumps({"offline_in": ["1.0.1"]}))
    device.deliver("1.0.1", probation_s=12.0)
    before = fingerprint(device.releases / BASE_VERSION)
    done, _ = run_update(device)
    assert done["state"] == "ROLLED_BACK"
    assert done["code"] == "agent_reverted"
    assert "not confirmed within 12 s" in str(done["error"])
    assert_previous_runs_untouched(device, done, before)


def test_a_release_whose_dependency_is_missing_offline_fails_and_nothing_switches(device: Device) -> None:
    device.deliver("1.0.4")
    before = fingerprint(device.releases / BASE_VERSION)
    done, service = run_update(device)
    assert done["state"] == "FAILED"
    assert done["code"] == "agent_install_failed"
    assert ABSENT.split(">")[0] in str(done["error"])
    assert_previous_runs_untouched(device, done, before)
    assert not (device.releases / "1.0.4").exists()
    assert not [s for s in service.lines("statuses.jsonl") if s["state"] == "PROBATION"]


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"python": "3.9"}, "the release is for Python 3.9"),
        ({"platforms": ["armv7l" if platform.machine() != "armv7l" else "x86_64"]}, "the release is for"),
    ],
    ids=["other-python", "other-machine"],
)
def test_a_release_for_another_python_or_machine_is_rejected_untouched(
    device: Device, fields: dict[str, Any], why: str
) -> None:
    device.deliver("1.0.1", **fields)
    before = fingerprint(device.releases / BASE_VERSION)
    done, _ = run_update(device)
    assert done["state"] == "REJECTED"
    assert done["code"] == "agent_incompatible"
    assert why in str(done["error"])
    assert_previous_runs_untouched(device, done, before)
    assert sorted(p.name for p in device.releases.iterdir()) == [BASE_VERSION, "current", "good"]


def test_the_next_release_needs_only_the_wheels_that_changed(device: Device) -> None:
    """Two releases sharing a dependency: the second one's job delivers only the agent's new wheel;
    the shared one is installed from the wheels held by hash. After it, the first release stays
    (the one before), the base one and its wheels go."""
    device.deliver("1.0.5", others=("extra",))
    done, _ = run_update(device)
    assert done == {"state": "ACTIVE", "release": "1.0.5"}

    device.deliver("1.0.6", job_id="job-2", others=("extra",), others_held=True)
    assert list(json.loads((device.state / "job.json").read_text())["artifacts"]) == [
        device.built.wheels["1.0.6"].name
    ]
    done, _ = run_update(device)
    assert done == {"state": "ACTIVE", "release": "1.0.6"}
    site = next((device.releases / "1.0.6" / "lib").glob("python3*/site-packages"))
    assert (site / "edge_agent_test_extra.py").is_file()
    assert sorted(p.name for p in device.releases.iterdir() if p.is_dir() and not p.is_symlink()) == [
        "1.0.5", "1.0.6", "wheels",
    ]  # fmt: skip
    held = {p.name for p in (device.releases / "wheels").iterdir()}
    assert len(held) == 3  # the shared wheel once, and each release's own agent wheel
