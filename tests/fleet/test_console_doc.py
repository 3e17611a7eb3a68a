"""docs/console.md shows what the console really sends: the JSON examples have the keys of real
answers, the read-only refusal is the server's own text, the token-file example works."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from agent.errors import ConfigError
from agent.fleet.console import console_token, make_console_app
from agent.fleet.gate import DeviceEnd
from agent.fleet.rollout_store import WaveState
from agent.fleet.view import FleetView
from tests.fleet.console_rig import StoreActions, failed_job, feed, fleet_messages, make_rollout, new_store

DOC = (Path(__file__).resolve().parents[2] / "docs" / "console.md").read_text(encoding="utf-8")
PREFIX = "fleet/v1"


def _json_after(heading: str) -> Any:
    match = re.search(rf"### {re.escape(heading)}\n+```json\n(.*?)\n```", DOC, re.DOTALL)
    assert match, f"docs/console.md has no '### {heading}' section with a ```json example"
    return json.loads(match.group(1))


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    view = FleetView(PREFIX)
    feed(view, fleet_messages(PREFIX, ["jet-01"]))
    feed(view, [failed_job(PREFIX, "jet-01")])
    store = new_store(tmp_path)
    make_rollout(store, "r-2026-05", [["jet-01"], ["jet-02"]])
    store.set_wave("r-2026-05", 0, WaveState.RUNNING)
    store.mark_sending("r-2026-05", "jet-01")
    store.mark_sent("r-2026-05", "jet-01")
    store.record_job("r-2026-05", "jet-01", DeviceEnd.ACTIVE)
    store.set_wave("r-2026-05", 0, WaveState.DONE, figures={"ended": 1, "failed": 0, "max_failed": 0})
    return TestClient(make_console_app(view, store, StoreActions(store), token=None))


def test_the_device_row_example_has_the_keys_of_a_real_row(client: TestClient) -> None:
    real = client.get("/api/devices").json()["devices"][0]
    doc = _json_after("A device row")

    assert sorted(doc) == sorted(real)
    assert sorted(doc["job"]) == sorted(real["job"])
    assert doc["job"] == real["job"]


def test_the_rollout_summary_example_has_the_keys_of_a_real_summary(client: TestClient) -> None:
    real = client.get("/api/rollouts").json()["rollouts"][0]
    doc = _json_after("A rollout summary")

    assert sorted(doc) == sorted(real)
    assert sorted(doc["waves"][0]) == sorted(real["waves"][0])
    assert sorted(doc["devices"]) == sorted(real["devices"])


def test_the_documented_refusal_is_what_a_read_only_console_answers(client: TestClient) -> None:
    answer = client.post("/api/rollouts/r-2026-05/pause", headers={"authorization": "Bearer x"})
    documented = re.search(r"every action answers 403:\n+```json\n(.*?)\n```", DOC, re.DOTALL)

    assert documented
    assert answer.status_code == 403
    assert answer.json() == json.loads(documented.group(1))


def test_the_token_file_is_read_as_a_secret(tmp_path: Path) -> None:
    token_file = tmp_path / "console.token"
    token_file.write_text("abc123\n")
    token_file.chmod(0o600)

    assert console_token(token_file) == "abc123"
    assert console_token(None) is None
    with pytest.raises(ConfigError, match="cannot read secret file"):
        console_token(tmp_path / "missing")
    assert "head -c 32 /dev/urandom | base64 > /etc/edge-agent/console.token" in DOC


def test_the_doc_names_every_route_the_app_serves(client: TestClient) -> None:
    for route in ("/api/devices", "/api/device/ID", "/api/rollouts", "/api/rollout/ID", "/events"):
        assert f"`GET {route}" in DOC, route
    paths = {getattr(r, "path", "") for r in client.app.routes}  # type: ignore[attr-defined]
    assert {"/api/devices", "/api/device/{device_id}", "/api/rollout/{rollout_id}", "/events"} <= paths
