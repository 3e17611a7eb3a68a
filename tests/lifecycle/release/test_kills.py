"""A SIGKILL at every step of an agent update, on real processes: after each kill the device starts one
of the two releases and its records say which; the job then ends once, in the state it would have
reached without the kill. The steps are named by the test-only stop points
(:func:`agent.lifecycle.release.layout.stop_point`)."""

from __future__ import annotations

import json
import signal

import pytest

from agent.lifecycle.release.layout import Releases
from tests.lifecycle.release.releases import BASE_VERSION, Device, run_update

pytestmark = pytest.mark.slow

TERMINAL = {"ACTIVE", "ROLLED_BACK", "FAILED", "REJECTED"}

#: Steps of an update that ends ACTIVE, in the order they run (install, apply in the old release,
#: the launcher's count, the new release's start and confirmation).
CONFIRMED_STEPS = [
    "venv-created",
    "pip-done",
    "update-recorded",
    "current-link-written",
    "current-switched",
    "attempt-counted",
    "start-counted",
    "confirm-recorded",
    "good-link-written",
    "confirmed-good",
    "confirmed-outcome",
]
#: Steps of an update put back by the launcher (a release that fails at import).
REVERTED_STEPS = ["revert-recorded", "reverted-link", "reverted-outcome"]


def check_after_kill(device: Device, candidate: str) -> None:
    """What a kill may leave: each link names one of the two complete releases, the records read."""
    releases = Releases(device.releases)
    for name in ("current", "good"):
        assert releases.link(name) in {BASE_VERSION, candidate}, name
        assert releases.is_complete(str(releases.link(name))), name
    update = releases.read_update()
    if update is not None:
        assert {update.previous, update.candidate} == {BASE_VERSION, candidate}
    releases.read_outcome()


def kill_and_finish(device: Device, version: str, step: str) -> dict[str, object]:
    device.deliver(version)
    kills: list[str] = []

    def on_kill() -> None:
        check_after_kill(device, version)
        kills.append(step)

    done, service = run_update(device, stop_at=step, on_kill=on_kill)
    assert kills == [step], service.output()[-3000:]
    assert -signal.SIGKILL in service.exits
    statuses = [s["state"] for s in service.lines("statuses.jsonl")]
    assert [s for s in statuses if s in TERMINAL] == [done["state"]], statuses
    assert not (device.releases / "update.json").exists()
    return done


@pytest.mark.parametrize("step", CONFIRMED_STEPS)
def test_a_kill_at_any_step_of_a_good_update_still_ends_active(device: Device, step: str) -> None:
    done = kill_and_finish(device, "1.0.1", step)
    assert done == {"state": "ACTIVE", "release": "1.0.1"}
    assert device.link("current") == device.link("good") == "1.0.1"


@pytest.mark.parametrize("step", REVERTED_STEPS)
def test_a_kill_at_any_step_of_a_put_back_still_ends_rolled_back(device: Device, step: str) -> None:
    done = kill_and_finish(device, "1.0.2", step)
    assert done["state"] == "ROLLED_BACK"
    assert "crashed at import" in str(done["error"])
    assert device.link("current") == device.link("good") == BASE_VERSION
    assert json.loads((device.releases / "outcome.json").read_text())["outcome"] == "rolled_back"
