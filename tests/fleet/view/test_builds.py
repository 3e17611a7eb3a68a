"""FleetView.builds: the latest build progress of each BUILDING job, one per device, in memory, gone
once the job moves on or the device goes offline (what ``rollout status`` and the console list)."""

from __future__ import annotations

from agent.fleet.view.live import FleetView
from agent.protocol.messages import BuildProgressInfo, JobState
from tests.fleet.view.test_live import PREFIX, job, status


def progress(phase: str = "calibrating", done: int | None = 120, elapsed: float = 42.0) -> BuildProgressInfo:
    fields: dict[str, object] = {"phase": phase, "elapsed_s": elapsed, "estimate_s": 310.0}
    if done is not None:
        fields.update(frames_done=done, frames_total=500)
    return BuildProgressInfo.model_validate(fields)


def online_view(*devices: str) -> FleetView:
    view = FleetView(PREFIX)
    for device in devices:
        view.apply(status(device, "online", 1))
    return view


def test_a_building_job_shows_its_latest_progress_until_it_leaves_building() -> None:
    view = online_view("jet-01", "jet-02")
    view.apply(job("jet-01", "r-1", JobState.BUILDING, 10.0, build=progress(done=40, elapsed=12.0)))
    view.apply(job("jet-01", "r-1", JobState.BUILDING, 12.0, build=progress(done=120)))
    view.apply(job("jet-02", "r-1", JobState.BUILDING, 12.0, progress=0.3))  # no build figures: none kept
    building = view.builds()

    view.apply(job("jet-01", "r-1", JobState.VALIDATING, 20.0))

    assert building == {("jet-01", "r-1"): progress(done=120)}
    assert view.builds() == {}
    assert view.device("jet-01").jobs[0].build is None  # type: ignore[union-attr]


def test_one_build_per_device_and_none_for_a_device_that_went_offline() -> None:
    view = online_view("jet-01", "jet-02")
    # A job superseded while building never sends BUILDING's end: the device's next build replaces it.
    view.apply(job("jet-01", "r-1", JobState.BUILDING, 10.0, build=progress()))
    view.apply(job("jet-01", "r-2", JobState.BUILDING, 11.0, build=progress("building", done=None)))
    view.apply(job("jet-02", "r-2", JobState.BUILDING, 11.0, build=progress()))
    both = set(view.builds())

    view.apply(status("jet-02", "offline", 1))  # its Last Will: the build ended with its process

    assert both == {("jet-01", "r-2"), ("jet-02", "r-2")}
    assert view.builds() == {("jet-01", "r-2"): progress("building", done=None)}
    assert [j.build is not None for j in view.device("jet-01").jobs] == [True, False]  # type: ignore[union-attr]


def test_a_late_older_building_status_does_not_bring_an_ended_build_back() -> None:
    view = online_view("jet-01")
    view.apply(job("jet-01", "r-1", JobState.BUILDING, 10.0, build=progress()))
    view.apply(job("jet-01", "r-1", JobState.ACTIVE, 30.0))
    view.apply(job("jet-01", "r-1", JobState.BUILDING, 11.0, build=progress(done=200)))  # spool replay

    assert view.builds() == {}
