"""The console's evidence route with Starlette's TestClient: the token, an unknown device, a job
the device kept nothing for, and the frames with both outputs.

The device is simulated with its own code (tests/fleet/console_rig.py's :func:`simulated_evidence`:
the device's EvidenceStore and EvidenceCommand); tests/e2e/test_evidence.py asks a real agent."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from agent.errors import AgentError
from agent.fleet.console import make_console_app
from agent.fleet.devices.command import DeviceRefusedError
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.protocol.command_args import EvidenceArgs
from agent.protocol.messages import CommandReply
from agent.runtime.slots.evidence import EvidenceCommand, EvidenceStore
from tests.fleet.console_rig import EVIDENCE_CLASSES, StoreActions, feed, fleet_messages, new_store

PREFIX = "fleet/v1"


class _Actions(StoreActions):
    """Jobs named ``kept-*`` have evidence; any other is asked of a device's empty EvidenceStore,
    whose refusal comes back as the controller gets it (a DeviceRefusedError)."""

    def evidence(self, device_id: str, job_id: str) -> dict[str, Any]:
        if job_id.startswith("kept-"):
            return super().evidence(device_id, job_id)
        self.calls.append(("evidence", device_id))
        try:
            return EvidenceCommand(EvidenceStore(), lambda: 256 * 1024)(EvidenceArgs(job_id=job_id))
        except AgentError as exc:
            raise DeviceRefusedError(
                CommandReply(command="evidence", ok=False, error_code=exc.code, error=str(exc))
            ) from exc


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RolloutStore]:
    s = new_store(tmp_path)
    yield s
    s.close()


@pytest.fixture
def view() -> FleetView:
    v = FleetView(PREFIX)
    feed(v, fleet_messages(PREFIX, ["jet-00"]))
    return v


def test_the_evidence_route_needs_the_token_and_answers_frames(view: FleetView, store: RolloutStore) -> None:
    token = secrets.token_urlsafe(16)
    auth = {"authorization": f"Bearer {token}"}
    actions = _Actions(store, view)
    client = TestClient(make_console_app(view, store, actions, token=token))
    read_only = TestClient(make_console_app(view, store, actions, token=None))

    assert read_only.post("/api/devices/jet-00/evidence/kept-1", headers=auth).status_code == 403
    assert client.post("/api/devices/jet-00/evidence/kept-1").status_code == 401
    assert client.post("/api/devices/jet-99/evidence/kept-1", headers=auth).status_code == 404
    assert client.post("/api/devices/jet-00/evidence/" + "j" * 129, headers=auth).status_code == 400
    assert actions.calls == []  # none of them reached the device
    missing = client.post("/api/devices/jet-00/evidence/job-7", headers=auth)
    answer = client.post("/api/devices/jet-00/evidence/kept-1", headers=auth)

    assert missing.status_code == 404
    assert "no evidence kept for job 'job-7'" in missing.json()["error"]
    assert answer.status_code == 200
    assert answer.headers["cache-control"] == "no-store"
    found = answer.json()["evidence"]
    assert (found["job_id"], found["reason"]) == ("kept-1", "shadow_disagrees")
    assert [f["serving"]["classes"][0]["label"] for f in found["frames"]] == [o for o, _ in EVIDENCE_CLASSES]
    assert [f["candidate"]["classes"][0]["label"] for f in found["frames"]] == [
        n for _, n in EVIDENCE_CLASSES
    ]
    assert all(base64.b64decode(f["jpeg_base64"]).startswith(b"\xff\xd8") for f in found["frames"])
