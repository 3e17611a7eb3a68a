"""The fleet console's HTTP side with Starlette's TestClient: the JSON API over a real FleetView and a
real RolloutStore, the token on actions, selector filtering, escaping, the live feed's frames."""

from __future__ import annotations

import ast
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.types import Receive, Scope, Send

from agent.errors import ConfigError
from agent.fleet.console import make_console_app, serve_console
from agent.fleet.console.app import (
    AUTH_MISSING_REFUSAL,
    AUTH_WRONG_REFUSAL,
    READ_ONLY_REFUSAL,
    SECURITY_HEADERS,
)
from agent.fleet.console.feed import Feed, Stream
from agent.fleet.console.rollouts import rollout_summary
from agent.fleet.console.summary import DeviceFilter
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import RolloutState, WaveState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from tests.fleet.console_rig import (
    StoreActions,
    failed_job,
    feed,
    fleet_messages,
    gate_figures,
    info,
    make_rollout,
    new_store,
    status,
    telemetry,
)
from tests.waiting import patient

PREFIX = "fleet/v1"
TOKEN = "s3cret-token-for-tests"
DEVICES = [f"jet-{i:02d}" for i in range(6)]
AGENT = Path(__file__).resolve().parents[3] / "agent"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RolloutStore]:
    s = new_store(tmp_path)
    yield s
    s.close()


@pytest.fixture
def view() -> FleetView:
    v = FleetView(PREFIX)
    feed(v, fleet_messages(PREFIX, DEVICES))
    return v


def _client(view: FleetView, store: RolloutStore, token: str | None = TOKEN, **kw: object) -> TestClient:
    return TestClient(make_console_app(view, store, StoreActions(store, view), token=token, **kw))  # type: ignore[arg-type]


def test_the_devices_api_lists_every_device_with_its_figures(view: FleetView, store: RolloutStore) -> None:
    body = _client(view, store).get("/api/devices").json()

    assert [d["id"] for d in body["devices"]] == DEVICES
    first = body["devices"][0]
    assert first["state"] == "online"
    assert first["models"] == {"main": "mobilenet:4"}
    assert first["labels"] == {"site": "berlin"}
    assert (first["fps"], first["p99_ms"], first["cpu"], first["temp_c"]) == (25.0, 41.5, 37.0, 51.5)
    assert body["total"] == len(DEVICES)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("select=site=paris", ["jet-01", "jet-03", "jet-05"]),
        ("select=site in (berlin),platform.dla_cores>=2", ["jet-00", "jet-02", "jet-04"]),
        ("select=platform.dla_cores>2", []),
        ("state=offline", ["jet-02"]),
        ("state=online&select=site=berlin", ["jet-00", "jet-04"]),
        ("model=mobilenet:7", ["jet-03"]),
        ("model=7", ["jet-03"]),
        ("model=mobilenet", DEVICES),
    ],
)
def test_the_devices_api_filters_by_selector_state_and_model(
    view: FleetView, store: RolloutStore, query: str, expected: list[str]
) -> None:
    feed(view, [status(PREFIX, "jet-02", "offline"), info(PREFIX, "jet-03", site="paris", version="7")])

    body = _client(view, store).get(f"/api/devices?{query}").json()

    assert [d["id"] for d in body["devices"]] == expected


def test_a_bad_selector_is_refused_with_the_selectors_own_message(
    view: FleetView, store: RolloutStore
) -> None:
    client = _client(view, store)

    bad = client.get("/api/devices", params={"select": "site=berlin,,"})
    state = client.get("/api/devices", params={"state": "sleeping"})

    assert bad.status_code == 400
    # The page's field is "Selector": its error names no CLI flag.
    assert bad.json()["error"].startswith("selector: at column ")
    assert "--select" not in bad.json()["error"]
    assert state.status_code == 400
    assert "online, offline, unknown, stale" in state.json()["error"]


def test_the_device_api_has_slots_temperatures_jobs_and_an_hour_of_charts(
    view: FleetView, store: RolloutStore
) -> None:
    feed(view, [telemetry(PREFIX, "jet-00", fps=30.0), failed_job(PREFIX, "jet-00")])
    client = _client(view, store)

    body = client.get("/api/device/jet-00").json()
    missing = client.get("/api/device/nobody")

    assert body["slots"]["main"]["model_id"] == "mobilenet"
    assert body["temperatures"] == {"cpu_therm": 51.5, "gpu_therm": 49.0}
    assert body["history"]["fps"] == [25.0, 30.0]
    assert len(body["history"]["ts"]) == 2
    assert body["history"]["p99_ms"] == [41.5, 41.5]
    job = body["jobs"][0]
    assert (job["state"], job["error_code"]) == ("ROLLED_BACK", "unhealthy")
    assert job["shadow"]["agreement"] == 0.97
    assert job["probation"]["current"] == {"p99_ms": 130.0}
    assert body["row"]["job"] == {"slot": "main", "state": "ROLLED_BACK", "code": "unhealthy"}
    assert missing.status_code == 404


def test_rollouts_show_waves_with_counts_per_step_and_end_and_gate_figures(
    view: FleetView, store: RolloutStore
) -> None:
    make_rollout(store, "r-1", [DEVICES[:2], DEVICES[2:]])
    store.set_wave("r-1", 0, WaveState.RUNNING)
    for device in DEVICES[:2]:
        store.mark_sending("r-1", device)
        store.mark_sent("r-1", device)
    store.record_job("r-1", DEVICES[0], DeviceEnd.ACTIVE)
    store.record_job("r-1", DEVICES[1], DeviceEnd.FAILED, {"error_code": "build_failed"})
    figures = gate_figures({"ACTIVE": 1, "FAILED": 1}, failed=1)
    store.set_wave("r-1", 0, WaveState.TRIPPED, figures=figures, reason="1 of 2 failed")
    client = _client(view, store)

    listed = client.get("/api/rollouts").json()["rollouts"]
    one = client.get("/api/rollout/r-1").json()

    assert [r["rollout_id"] for r in listed] == ["r-1"]
    first, second = one["waves"]
    # When each wave started and ended, as `rollout status` prints them.
    started, ended = first.pop("started_at"), first.pop("ended_at")
    assert isinstance(started, float)
    assert isinstance(ended, float)
    assert started <= ended
    assert (second["started_at"], second["ended_at"]) == (None, None)
    assert first == {
        "index": 0,
        "wave": 1,  # counted from 1, as the page and the CLI show it (issue 22.6)
        "state": "TRIPPED",
        "devices": 2,
        "steps": {"ENDED": 2},
        "ends": {"ACTIVE": 1, "FAILED": 1},
        "figures": figures,
        "reason": "1 of 2 failed",
        "soak_left_s": None,
    }
    assert one["policy"] == {
        "waves": "2,4",
        "max_failed": "2%",
        "soak_s": 600,
        "wave_timeout_s": None,
        "on_timeout": None,
        "rollback_on_abort": None,
    }
    assert (second["state"], second["steps"]) == ("WAITING", {"PLANNED": 4})
    assert one["devices"]["total"] == 6
    assert [d["figures"] for d in one["device_rows"][:2]] == [None, {"error_code": "build_failed"}]
    assert client.get("/api/rollout/nope").status_code == 404


def test_a_summary_has_the_soak_left_and_the_rollback_outcome_as_status_prints_them(
    store: RolloutStore,
) -> None:
    make_rollout(store, "r-1", [DEVICES[:2], DEVICES[2:]])
    store.set_wave("r-1", 0, WaveState.RUNNING)
    soaking = {**gate_figures({"ACTIVE": 2}), "soak_until": 1_000_600.0}
    store.set_wave("r-1", 0, WaveState.SOAKING, figures=soaking, reason="soaking 600 s")
    before = rollout_summary(store, "r-1", now=1_000_000.4)
    due = rollout_summary(store, "r-1", now=1_000_700.0)
    # The abort's rollback as the controller's planner notes it (agent/fleet/rollout/rollback.py).
    store.set_state("r-1", RolloutState.ABORTED, "aborted by the operator")
    store.note("r-1", "rollback", sha256="ab" * 32, devices=DEVICES[:2], job_id="r-1-rollback-abababab")
    store.note("r-1", "rollback_none", devices=[], why="no previous model in the slot")
    going = rollout_summary(store, "r-1", now=1_000_700.0)
    store.note("r-1", "rollback_done", ends={DEVICES[0]: "ACTIVE", DEVICES[1]: "FAILED"})
    done = rollout_summary(store, "r-1", now=1_000_700.0)

    assert [w["soak_left_s"] for w in before["waves"]] == [600, None]
    assert before["rollback"] is None
    assert due["waves"][0]["soak_left_s"] == 0  # past due: never negative
    assert going["waves"][0]["soak_left_s"] is None  # the abort ended the soak
    assert going["rollback"] == {"by_desired_state": 2, "by_command": 0, "no_previous": [], "ends": None}
    assert done["rollback"]["ends"] == {"ACTIVE": 1, "FAILED": 1}


def test_finished_rollouts_are_listed_after_the_open_ones(view: FleetView, store: RolloutStore) -> None:
    make_rollout(store, "old", [["a"]])
    store.set_state("old", RolloutState.ABORTED)
    make_rollout(store, "new", [["b"]])

    listed = _client(view, store).get("/api/rollouts").json()["rollouts"]

    assert [(r["rollout_id"], r["state"]) for r in listed] == [("new", "RUNNING"), ("old", "ABORTED")]


def test_actions_are_refused_without_a_configured_token(view: FleetView, store: RolloutStore) -> None:
    make_rollout(store, "r-1", [DEVICES])
    client = _client(view, store, token=None)

    refused = client.post("/api/rollouts/r-1/pause", headers={"authorization": "Bearer anything"})

    assert refused.status_code == 403
    assert refused.json()["error"] == READ_ONLY_REFUSAL
    assert store.rollout("r-1").state is RolloutState.RUNNING


@pytest.mark.parametrize(
    ("authorization", "refusal"),
    [
        (None, AUTH_MISSING_REFUSAL),
        ("Bearer", AUTH_MISSING_REFUSAL),
        ("Bearer   ", AUTH_MISSING_REFUSAL),
        ("Bearer wrong", AUTH_WRONG_REFUSAL),
        (f"Basic {TOKEN}", AUTH_WRONG_REFUSAL),
        (f"Bearer {TOKEN}x", AUTH_WRONG_REFUSAL),
        (f"bearer{TOKEN}", AUTH_WRONG_REFUSAL),
    ],
)
def test_actions_are_refused_without_the_right_token(
    view: FleetView, store: RolloutStore, authorization: str | None, refusal: str
) -> None:
    make_rollout(store, "r-1", [DEVICES])
    headers = {} if authorization is None else {"authorization": authorization}

    refused = _client(view, store).post("/api/rollouts/r-1/pause", headers=headers)

    assert refused.status_code == 401
    assert refused.json()["error"] == refusal  # a missing token told apart from a wrong one
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert store.rollout("r-1").state is RolloutState.RUNNING


def test_pause_resume_and_abort_work_with_the_token(view: FleetView, store: RolloutStore) -> None:
    make_rollout(store, "r-1", [DEVICES[:2], DEVICES[2:]])
    client = _client(view, store)
    auth = {"authorization": f"Bearer {TOKEN}"}

    paused = client.post("/api/rollouts/r-1/pause", headers=auth)
    state_after_pause = store.rollout("r-1").state
    again = client.post("/api/rollouts/r-1/pause", headers=auth)
    resumed = client.post("/api/rollouts/r-1/resume", headers=auth)
    aborted = client.post("/api/rollouts/r-1/abort?rollback=1", headers=auth)
    unknown = client.post("/api/rollouts/r-1/explode", headers=auth)

    assert paused.json() == {"ok": True, "message": "paused"}
    assert state_after_pause is RolloutState.PAUSED
    assert again.status_code == 409
    assert "PAUSED -> PAUSED" in again.json()["error"]
    assert resumed.json()["message"] == "resumed"
    assert aborted.json()["message"] == "aborted (rolling back)"
    assert store.rollout("r-1").state is RolloutState.ABORTED
    assert store.waves("r-1")[1][0] is WaveState.CANCELLED
    assert unknown.status_code == 404


def test_decommission_needs_the_token_and_the_device_leaves_the_console(
    view: FleetView, store: RolloutStore
) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    read_only = _client(view, store, token=None).post("/api/devices/jet-01/decommission", headers=auth)
    client = _client(view, store)
    no_token = client.post("/api/devices/jet-01/decommission")
    still_there = client.get("/api/device/jet-01").status_code

    done = client.post("/api/devices/jet-01/decommission", headers=auth)
    again = client.post("/api/devices/jet-01/decommission", headers=auth)

    assert (read_only.status_code, no_token.status_code, still_there) == (403, 401, 200)
    assert done.json() == {"ok": True, "message": "device jet-01 decommissioned"}
    assert client.get("/api/device/jet-01").status_code == 404
    assert "jet-01" not in [row["id"] for row in client.get("/api/devices").json()["devices"]]
    assert again.status_code == 409
    assert "no device 'jet-01'" in again.json()["error"]


def test_a_telemetry_name_of_ten_megabytes_does_not_come_back_from_the_device_api(
    view: FleetView, store: RolloutStore
) -> None:
    topic, _ = telemetry(PREFIX, "jet-00", fps=30.0)
    payload = b'{"ts": 1.0, "cpu.percent": 12.0, "' + b"n" * 10_000_000 + b'": 1.0}'
    feed(view, [(topic, payload)])

    answer = _client(view, store).get("/api/device/jet-00")

    assert answer.status_code == 200
    assert len(answer.content) < 16 * 1024, len(answer.content)
    assert answer.json()["telemetry"] == {"cpu.percent": 12.0}
    assert "figure(s) named with over 512 characters left out" in answer.json()["problems"][0]


def test_the_device_api_says_since_when_the_charts_have_data(store: RolloutStore) -> None:
    clock = [1_000_000.0]
    view = FleetView(PREFIX, history_s=3600, clock=lambda: clock[0])
    feed(view, [telemetry(PREFIX, "jet-00", fps=30.0)])
    client = _client(view, store)

    just_started = client.get("/api/device/jet-00").json()["history_since"]
    clock[0] += 7200
    later = client.get("/api/device/jet-00").json()["history_since"]

    assert just_started == 1_000_000.0  # the view's start: nothing older can be on the charts
    assert later == 1_000_000.0 + 7200 - 3600  # an hour ago


def test_device_text_stays_text_in_the_api_and_the_page_never_writes_markup(
    view: FleetView, store: RolloutStore
) -> None:
    hostile = '<img src=x onerror="alert(1)">'
    feed(view, [info(PREFIX, "jet-00", model=hostile)])
    client = _client(view, store)

    response = client.get("/api/devices")
    script = client.get("/static/console.js").text

    assert response.headers["content-type"] == "application/json"
    assert response.json()["devices"][0]["models"] == {"main": f"{hostile}:4"}
    # The page builds the document from text nodes: no HTML parsing of anything it receives.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_every_response_carries_a_content_security_policy_without_inline_scripts(
    view: FleetView, store: RolloutStore
) -> None:
    client = _client(view, store)

    page = client.get("/device/jet-00")
    api = client.get("/api/rollouts")

    assert page.status_code == 200
    assert '<script src="/static/console.js"' in page.text
    assert "<script>" not in page.text
    for response in (page, api):
        for name, value in SECURITY_HEADERS:
            assert response.headers[name.decode()] == value.decode()
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_no_page_loads_anything_from_another_host(view: FleetView, store: RolloutStore) -> None:
    client = _client(view, store)
    html = client.get("/").text

    for asset in (
        "/static/console.js",
        "/static/console.css",
        "/static/uPlot.iife.min.js",
        "/static/uPlot.min.css",
    ):
        assert asset in html
        assert client.get(asset).status_code == 200
    assert "http://" not in html
    assert "https://" not in html


def test_metrics_app_is_served_at_metrics(view: FleetView, store: RolloutStore) -> None:
    async def metrics(scope: Scope, receive: Receive, send: Send) -> None:
        # A plain ASGI function, as prometheus_client.make_asgi_app returns.
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"edge_devices 6\n"})

    with_metrics = _client(view, store, metrics_app=metrics)
    without = _client(view, store)

    assert with_metrics.get("/metrics").text == "edge_devices 6\n"
    assert without.get("/metrics").status_code == 404


def test_the_live_feed_sends_everything_once_then_only_what_changed(
    view: FleetView, store: RolloutStore
) -> None:
    make_rollout(store, "r-1", [DEVICES])
    stream = Stream(Feed(view, store, interval_s=0.0), DeviceFilter(), want_rollouts=True)

    first = _frames(stream.frame())
    quiet = stream.frame()
    feed(view, [status(PREFIX, "jet-03", "offline", session=1)])
    change = _frames(stream.frame())
    store.set_state("r-1", RolloutState.PAUSED)
    paused = _frames(stream.frame())

    devices = first["devices"]
    assert devices["full"] is True
    assert [r["id"] for r in devices["upsert"]] == DEVICES
    assert first["rollouts"]["rollouts"][0]["state"] == "RUNNING"
    assert quiet == ""
    assert change["devices"]["full"] is False
    assert [(r["id"], r["state"]) for r in change["devices"]["upsert"]] == [("jet-03", "offline")]
    assert "rollouts" not in change
    assert paused["rollouts"]["rollouts"][0]["state"] == "PAUSED"


def test_the_live_feed_removes_a_device_that_leaves_the_filter(view: FleetView, store: RolloutStore) -> None:
    stream = Stream(Feed(view, store, interval_s=0.0), DeviceFilter.parse({"state": "online"}))

    stream.frame()
    feed(view, [status(PREFIX, "jet-01", "offline")])
    change = _frames(stream.frame())

    assert change["devices"] == {"full": False, "upsert": [], "remove": ["jet-01"], "total": 5}


def test_the_served_console_streams_server_sent_events_and_stops(
    view: FleetView, store: RolloutStore
) -> None:
    """A real uvicorn on a free loopback port (TestClient cannot read an endless response)."""
    server = serve_console(make_console_app(view, store, StoreActions(store), token=None), "127.0.0.1", 0)
    try:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=patient(10))
        connection.request("GET", "/events?want=devices&select=site%3Dparis")
        response = connection.getresponse()
        head = [response.readline() for _ in range(5)]
        feed(view, [status(PREFIX, "jet-03", "offline")])
        change = [response.readline() for _ in range(3)]
        bad = http.client.HTTPConnection(server.host, server.port, timeout=patient(10))
        bad.request("GET", "/events?select=site%3Dberlin%2C%2C")
        bad_status = bad.getresponse().status
    finally:
        server.stop()

    assert response.getheader("content-type", "").startswith("text/event-stream")
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert head[:3] == [b"retry: 2000\n", b"\n", b"event: devices\n"]
    first = json.loads(head[3].removeprefix(b"data: "))
    assert [r["id"] for r in first["upsert"]] == ["jet-01", "jet-03", "jet-05"]
    assert change[0] == b"event: devices\n"
    assert json.loads(change[1].removeprefix(b"data: "))["upsert"][0]["state"] == "offline"
    assert bad_status == 400
    assert not server.running


def test_serving_on_a_port_in_use_fails_with_the_address(view: FleetView, store: RolloutStore) -> None:
    app = make_console_app(view, store, StoreActions(store), token=None)
    first = serve_console(app, "127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            serve_console(app, "127.0.0.1", first.port)
    finally:
        first.stop()


def _frames(text: str) -> dict[str, dict[str, Any]]:
    """The events of one frame by name (each event's data parsed)."""
    out = {}
    for block in text.strip().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out[name.removeprefix("event: ")] = json.loads(data.removeprefix("data: "))
    return out


def test_only_the_fleet_package_imports_the_console_or_its_web_stack() -> None:
    """The console's dependencies are the ``fleet`` extra's: a device imports none of them."""
    offenders = []
    for path in AGENT.rglob("*.py"):
        relative = path.relative_to(AGENT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                web = name.split(".")[0] in ("starlette", "uvicorn", "anyio")
                console = name.startswith("agent.fleet.console")
                if (web and not relative.startswith("fleet/console/")) or (
                    console and not relative.startswith("fleet/")
                ):
                    offenders.append(f"{relative}: {name}")
    assert offenders == []
