"""The console's JSON for the engines page and for the builds on the rollouts page, with Starlette's
TestClient over a real FleetView, a real RolloutStore and a real controller engine desk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from agent.fleet.console import make_console_app
from agent.fleet.engines.hooks import engines_listing
from agent.fleet.rollout.records import WaveState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import BuildProgressInfo, JobState, JobStatus, encode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.console_rig import StoreActions, feed, fleet_messages, make_rollout, new_store

PREFIX = "fleet/v1"
DEVICES = ["jet-00", "jet-01"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RolloutStore]:
    s = new_store(tmp_path)
    yield s
    s.close()


def test_the_engines_api_answers_the_controllers_listing_or_says_there_is_none(
    tmp_path: Path, store: RolloutStore
) -> None:
    view = FleetView(PREFIX)
    desk = make_desk(tmp_path / "engines", Ed25519PrivateKey.generate())
    with_engines = TestClient(
        make_console_app(
            view, store, StoreActions(store, view), token=None, engines=lambda: engines_listing(desk)
        )
    )
    without = TestClient(make_console_app(view, store, StoreActions(store, view), token=None))

    answer = with_engines.get("/api/engines")
    refused = without.get("/api/engines")
    page = with_engines.get("/engines")

    assert answer.status_code == 200
    assert answer.json() == engines_listing(desk)
    assert answer.headers["cache-control"] == "no-store"
    assert (refused.status_code, refused.json()) == (
        404,
        {"error": "this console serves no engine store (run it in the fleet controller)"},
    )
    assert page.status_code == 200
    assert 'id="nav-engines"' in page.text


def test_a_rollout_summary_lists_its_devices_building_from_the_view_and_drops_them_after(
    store: RolloutStore,
) -> None:
    view = FleetView(PREFIX)
    feed(view, fleet_messages(PREFIX, DEVICES))
    make_rollout(store, "r-1", [DEVICES])
    store.set_wave("r-1", 0, WaveState.RUNNING, reason="started")
    for device in DEVICES:
        store.mark_sending("r-1", device)
        store.mark_sent("r-1", device)
    client = TestClient(make_console_app(view, store, StoreActions(store, view), token=None))
    progress = BuildProgressInfo(phase="timing placements", elapsed_s=95.0, estimate_s=300.0)

    def job(state: JobState, build: BuildProgressInfo | None) -> InboundMessage:
        message = JobStatus(job_id="job-r-1", slot="main", state=state, build=build)
        return InboundMessage(Topics(PREFIX, "jet-01").jobs("job-r-1"), encode(message), qos=1, retain=False)

    view.apply(job(JobState.BUILDING, progress))
    listed = client.get("/api/rollouts").json()["rollouts"][0]
    one = client.get("/api/rollout/r-1").json()
    view.apply(job(JobState.VALIDATING, None))
    after = client.get("/api/rollout/r-1").json()

    assert listed["building"] == one["building"]
    assert one["building"] == [
        {
            "device": "jet-01",
            "wave": 1,
            "phase": "timing placements",
            "frames_done": None,
            "frames_total": None,
            "elapsed_s": 95.0,
            "estimate_s": 300.0,
            "note": "timing placements, 95 s of ~300 s",
        }
    ]
    assert (after["building"], after["building_left_off"]) == ([], 0)
