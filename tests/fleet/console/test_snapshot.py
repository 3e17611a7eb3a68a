"""The console's snapshot route with Starlette's TestClient: the token, an unknown device, one
snapshot in flight per device, and each refusal of the device answered with its own status.

The device is simulated (tests/fleet/console_rig.py's :func:`simulated_snapshot`, the device's own
encoder); tests/e2e/test_snapshot_logs.py asks a real agent through a real broker."""

from __future__ import annotations

import base64
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from agent.errors import AgentError
from agent.fleet.console import make_console_app
from agent.fleet.devices.command import NoReplyError
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.runtime.frames.snapshot_command import RateLimitedError
from tests.fleet.console_rig import StoreActions, feed, fleet_messages, new_store
from tests.waiting import patient

PREFIX = "fleet/v1"


class _Actions(StoreActions):
    """StoreActions whose snapshot can be held (to see a second click refused) or made to fail."""

    def __init__(self, store: RolloutStore, view: FleetView) -> None:
        super().__init__(store, view)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail: AgentError | None = None

    def snapshot(self, device_id: str, stream: str | None) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(patient(30))
        if self.fail is not None:
            raise self.fail
        return super().snapshot(device_id, stream)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RolloutStore]:
    s = new_store(tmp_path)
    yield s
    s.close()


@pytest.fixture
def view() -> FleetView:
    v = FleetView(PREFIX)
    feed(v, fleet_messages(PREFIX, ["jet-00", "jet-01"]))
    return v


def test_the_route_needs_the_token_and_a_known_device(view: FleetView, store: RolloutStore) -> None:
    token = secrets.token_urlsafe(16)
    auth = {"authorization": f"Bearer {token}"}
    actions = _Actions(store, view)
    client = TestClient(make_console_app(view, store, actions, token=token))
    read_only = TestClient(make_console_app(view, store, actions, token=None))

    assert read_only.post("/api/devices/jet-00/snapshot", headers=auth).status_code == 403
    assert client.post("/api/devices/jet-00/snapshot").status_code == 401
    assert client.post("/api/devices/jet-99/snapshot", headers=auth).status_code == 404
    assert client.post("/api/devices/jet-00/snapshot?stream=" + "s" * 129, headers=auth).status_code == 400
    assert actions.calls == []  # none of them reached the device
    answer = client.post("/api/devices/jet-00/snapshot?stream=cam0", headers=auth)
    assert answer.status_code == 200
    assert answer.headers["cache-control"] == "no-store"
    taken = answer.json()["snapshot"]
    assert taken["frame_index"] == 12
    assert [d["label"] for d in taken["result"]["detections"]] == ["square"]
    assert base64.b64decode(taken["jpeg_base64"]).startswith(b"\xff\xd8")
    wrong = client.post("/api/devices/jet-00/snapshot?stream=nope", headers=auth)
    assert wrong.status_code == 409
    assert "no stream 'nope'" in wrong.json()["error"]


def test_one_snapshot_in_flight_per_device(view: FleetView, store: RolloutStore) -> None:
    token = secrets.token_urlsafe(16)
    auth = {"authorization": f"Bearer {token}"}
    actions = _Actions(store, view)
    actions.release.clear()
    client = TestClient(make_console_app(view, store, actions, token=token))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/api/devices/jet-00/snapshot", headers=auth)
        assert actions.entered.wait(patient(30))
        second = client.post("/api/devices/jet-00/snapshot", headers=auth)
        actions.release.set()
        assert first.result(patient(30)).status_code == 200
    assert second.status_code == 429
    assert "already being taken" in second.json()["error"]
    assert client.post("/api/devices/jet-00/snapshot", headers=auth).status_code == 200  # freed again


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RateLimitedError("6 snapshots in the last minute (snapshot.per_minute: 6); retry in 41 s"), 429),
        (NoReplyError("no reply to command 'snapshot' from device 'jet-00' within 10s"), 504),
    ],
)
def test_the_devices_refusals_keep_their_meaning(
    view: FleetView, store: RolloutStore, error: AgentError, status: int
) -> None:
    token = secrets.token_urlsafe(16)
    actions = _Actions(store, view)
    actions.fail = error
    client = TestClient(make_console_app(view, store, actions, token=token))
    answer = client.post("/api/devices/jet-00/snapshot", headers={"authorization": f"Bearer {token}"})
    assert answer.status_code == status
    assert answer.json()["error"] == str(error)
