"""The fleet console in a real headless Chromium (the OS package, driven by Playwright).

Everything on the way is real: devices publish protocol messages to a real mosquitto, a service
client feeds them into a FleetView, uvicorn serves the console on a free loopback port, rollout
transitions are written to a real RolloutStore file, and the page is rendered by Chromium. The
test also takes the screenshots that docs/console.md and the README show: into docs/img/console-*.png
with ``EDGE_AGENT_SCREENSHOTS=1`` (how the committed ones were made), into a temporary folder
otherwise, so an ordinary ``make test`` leaves the checkout clean.

Chromium: ``/usr/bin/chromium`` (tools/os-deps.sh installs Debian's ``chromium``); Playwright's
own browser download is never used.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright

from agent.demo.broker import Broker
from agent.fleet.console import make_console_app, serve_console
from agent.fleet.console.server import ConsoleServer
from agent.fleet.rollout.building import Waits
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import RolloutState, WaveState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.mqtt.service_client import ServiceClient
from agent.protocol.device_targets import TargetInfo
from tests.fleet.console_rig import (
    EVIDENCE_CLASSES,
    SNAPSHOT_BOX,
    SNAPSHOT_SIZE,
    StoreActions,
    failed_job,
    fleet_messages,
    gate_figures,
    info,
    make_rollout,
    new_store,
    status,
    telemetry,
)
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient_ms, wait_until

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
DOCS_IMG = Path(__file__).resolve().parents[3] / "docs" / "img"
#: The console token of this run (made at run time: a token is never a constant).
TOKEN = secrets.token_urlsafe(16)
DEVICES = [f"jet-{i:02d}" for i in range(8)]
#: How long the page may take to show a change (the feed sends at most one frame a second).
SHOWS_WITHIN_MS = patient_ms(5)


@dataclass
class Console:
    """A served console over a fleet of simulated devices that publish through ``probe``."""

    prefix: str
    view: FleetView
    store: RolloutStore
    probe: Probe
    server: ConsoleServer

    def publish(self, messages: list[tuple[str, bytes]]) -> None:
        for topic, payload in messages:
            retained = topic.endswith(("/up/status", "/up/info"))
            self.probe.publish(topic, payload, qos=1, retain=retained)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: run tools/os-deps.sh")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


def _serve(
    broker: Broker,
    tmp_path: Path,
    token: str | None,
    engines: Callable[[], dict[str, Any]] | None = None,
    waits: Callable[[], Waits] | None = None,
) -> Iterator[Console]:
    """A console over a live fleet view on ``broker``; ``engines``: the engine listing it shows;
    ``waits``: who waits for whose build (an engine desk's claims)."""
    prefix = unique_prefix()
    view = FleetView(prefix)
    store = new_store(tmp_path)
    client = ServiceClient(operator_settings(broker, prefix), handler=view.apply)
    client.start()
    for topic_filter in view.topic_filters():
        client.subscribe(topic_filter, qos=1)
    server = serve_console(
        make_console_app(view, store, StoreActions(store, view), token=token, engines=engines, waits=waits),
        "127.0.0.1",
        0,
    )
    probe = Probe(broker.host, broker.port)
    try:
        yield Console(prefix, view, store, probe, server)
    finally:
        probe.close()
        server.stop()
        client.stop()
        store.close()


@pytest.fixture
def console(broker: Broker, tmp_path: Path) -> Iterator[Console]:
    yield from _serve(broker, tmp_path, TOKEN)


@pytest.fixture
def read_only_console(broker: Broker, tmp_path: Path) -> Iterator[Console]:
    yield from _serve(broker, tmp_path, None)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    # Playwright's own bounds (30 s for an action, 5 s for an expect) under the suite's patience.
    context.set_default_timeout(patient_ms(30))
    expect.set_options(timeout=patient_ms(5))
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    # Chromium logs each 4xx answer as an error: the API's are on purpose (a refused action, a
    # decommissioned device); anything else (a page's resource, the favicon) must load.
    p.on(
        "console",
        lambda m: (
            errors.append(m.text) if m.type == "error" and "/api/" not in m.location.get("url", "") else None
        ),
    )
    p.on(
        "response",
        lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 and "/api/" not in r.url else None,
    )
    yield p
    context.close()
    # A script error, a refused resource (CSP) or a 404 would show here: the page must run clean.
    assert errors == []


def _arrived(console: Console, count: int) -> None:
    wait_until(lambda: len(console.view.devices()) >= count, what=f"{count} devices in the view")


def _cells(page: Page, column: str) -> list[str]:
    return page.locator(f"#devices tbody td.{column}").all_inner_texts()


def test_the_devices_table_matches_the_fleet_and_a_device_going_offline_turns_offline(
    console: Console, page: Page
) -> None:
    hostile = '<img src=x onerror="document.body.dataset.pwned=1">\u202eevil'
    console.publish(list(fleet_messages(console.prefix, DEVICES)))
    console.publish([info(console.prefix, "jet-07", model=hostile, version="9")])
    _arrived(console, len(DEVICES))
    wait_until(lambda: "evil" in str(console.view.device("jet-07")), what="jet-07's new info")

    page.goto(console.server.url + "/")
    page.wait_for_selector(f"#devices tbody tr >> nth={len(DEVICES) - 1}")

    assert _cells(page, "id") == DEVICES
    assert page.locator("#devices tbody td.state .badge").all_inner_texts() == ["online"] * len(DEVICES)
    assert _cells(page, "models")[0] == "main=mobilenet:4"
    assert _cells(page, "fps")[:3] == ["25.0", "26.0", "27.0"]
    # A device's text is text: shown literally, its bidi override as an escape, no element made of it.
    shown_model = hostile.replace("\u202e", "\\u202e")
    assert _cells(page, "models")[7] == f"main={shown_model}:9"
    assert page.locator("main img").count() == 0
    assert page.evaluate("document.body.dataset.pwned") is None
    _screenshot(page, "console-devices.png")

    console.publish([status(console.prefix, "jet-03", "offline")])  # as its Last Will would write it
    page.wait_for_selector('#devices tr[data-device="jet-03"][data-state="offline"]', timeout=SHOWS_WITHIN_MS)

    assert page.locator('#devices tr[data-device="jet-03"] td.state .badge').inner_text() == "offline"
    assert page.locator('#devices tr[data-state="online"]').count() == len(DEVICES) - 1
    # Its last figures stay, greyed: the stale class and a tooltip saying why.
    offline_fps = page.locator('#devices tr[data-device="jet-03"] td.fps')
    assert "stale" in (offline_fps.get_attribute("class") or "")
    assert offline_fps.get_attribute("title") == "last figures heard before the device went offline"
    assert "stale" not in (
        page.locator('#devices tr[data-device="jet-02"] td.fps').get_attribute("class") or ""
    )
    # The favicon the page links, and the one browsers ask for on their own, both load.
    assert page.request.get(console.server.url + "/favicon.ico").status == 200
    icon = page.locator("link[rel=icon]").get_attribute("href")
    assert page.request.get(console.server.url + str(icon)).headers["content-type"] == "image/svg+xml"


def test_each_devices_configuration_and_agent_release_show_with_what_is_pending_and_what_was_put_back(
    console: Console, page: Page
) -> None:
    reverted = "config_reverted: stream cam0 delivered no frame for 30 s (it did before the change)"
    release = TargetInfo(version="0.3.1")
    console.publish(list(fleet_messages(console.prefix, DEVICES[:3])))
    console.publish(
        [
            info(console.prefix, "jet-00", config=TargetInfo(version="cfg-7"), agent_release=release),
            info(
                console.prefix,
                "jet-01",
                config=TargetInfo(version="cfg-6", pending="cfg-7"),
                agent_release=release,
            ),
            info(console.prefix, "jet-02", config=TargetInfo(version="cfg-6", reverted=reverted)),
        ]
    )
    _arrived(console, 3)
    wait_until(lambda: "reverted" in str(console.view.device("jet-02")), what="jet-02's targets")

    page.goto(console.server.url + "/")
    page.wait_for_selector("#devices tbody tr >> nth=2")
    assert _cells(page, "config") == ["cfg-7", "cfg-6 -> cfg-7", "cfg-6 (put back)"]
    assert _cells(page, "release") == ["0.3.1", "0.3.1", "-"]  # jet-02 does not report one
    put_back = page.locator('#devices tr[data-device="jet-02"] td.config')
    assert put_back.get_attribute("title") == reverted
    assert "error" in (put_back.get_attribute("class") or "")

    # jet-01 confirms cfg-7: the feed updates its row, nothing pending any more.
    console.publish(
        [info(console.prefix, "jet-01", config=TargetInfo(version="cfg-7"), agent_release=release)]
    )
    expect(page.locator('#devices tr[data-device="jet-01"] td.config')).to_have_text(
        "cfg-7", timeout=SHOWS_WITHIN_MS
    )

    page.goto(console.server.url + "/device/jet-02")
    expect(page.locator("#facts")).to_contain_text("cfg-6; put back: " + reverted)


def test_the_filters_narrow_the_table_and_a_bad_selector_says_why(console: Console, page: Page) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES)))
    console.publish([info(console.prefix, "jet-02", version="5")])
    _arrived(console, len(DEVICES))
    wait_until(lambda: "'5'" in str(console.view.device("jet-02")), what="jet-02 on version 5")
    page.goto(console.server.url + "/")
    page.wait_for_selector(f"#devices tbody tr >> nth={len(DEVICES) - 1}")

    page.fill("#filter-select", "site=paris")
    page.click("#filter-apply")
    # Locator waits, not wait_for_function: the page's CSP forbids the eval that one needs.
    expect(page.locator("#devices tbody tr")).to_have_count(4)
    paris = _cells(page, "id")
    page.fill("#filter-select", "")
    page.fill("#filter-model", "mobilenet:5")
    page.click("#filter-apply")
    expect(page.locator("#devices tbody tr")).to_have_count(1)
    on_five = _cells(page, "id")
    page.fill("#filter-select", "site in (paris")
    page.click("#filter-apply")
    page.wait_for_selector("#filter-error:not(:empty)")

    assert paris == ["jet-01", "jet-03", "jet-05", "jet-07"]
    assert on_five == ["jet-02"]
    error = page.inner_text("#filter-error")
    assert error.startswith("selector: at column ")
    assert "expected ',' or ')'" in error
    assert "--select" not in error  # the CLI's flag means nothing on the page


def test_the_device_page_shows_slots_charts_jobs_and_verdicts(console: Console, page: Page) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:1])))
    for i in range(30):
        console.publish([telemetry(console.prefix, "jet-00", fps=24.0 + (i % 7) * 0.5)])
    console.publish([failed_job(console.prefix, "jet-00")])
    wait_until(lambda: len(console.view.history("jet-00")) >= 31, what="31 telemetry points")
    wait_until(lambda: bool(console.view.device("jet-00").jobs), what="the job status")  # type: ignore[union-attr]

    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")

    assert "mobilenet" in page.inner_text("#slots")
    facts = page.inner_text("#facts")
    assert "site=berlin" in facts
    assert "Jetson Orin NX, JetPack 6.0, TensorRT 8.6.2, 2 DLA" in facts
    assert "[object" not in page.inner_text("main")
    assert page.locator("#chart-fps canvas").count() >= 1
    assert page.locator("#chart-latency canvas").count() >= 1
    assert "cpu_therm" in page.inner_text("#temperatures")
    jobs = page.inner_text("#jobs")
    assert "ROLLED_BACK" in jobs
    assert "unhealthy" in jobs
    verdicts = page.inner_text("#verdicts")
    assert "120 frames, agreement 0.97, latency x1.4" in verdicts
    assert "30s of 1m" in verdicts
    assert "{" not in verdicts  # no raw JSON
    # Probation: baseline against current as a table, the figure that failed named.
    figures = page.locator("#verdicts table.figures tbody tr").all_inner_texts()
    assert figures == ["p99_ms\t41.5\t130"]
    assert page.inner_text("#verdicts .failed-figure") == "p99_ms 130 crossed its bar 90"
    assert "(stale" not in page.inner_text("#facts")
    _screenshot(page, "console-device.png")

    console.publish([status(console.prefix, "jet-00", "offline")])
    page.wait_for_selector("#device-title .badge.offline", timeout=SHOWS_WITHIN_MS)


def test_an_offline_device_shows_its_figures_as_stale_and_a_steady_fps_as_flat(
    console: Console, page: Page
) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:1])))
    # A steady 10 fps with the jitter a real stream has: 9.99 .. 10.01.
    for i in range(20):
        console.publish([telemetry(console.prefix, "jet-00", fps=10.0 + (i % 3 - 1) * 0.01)])
    wait_until(lambda: len(console.view.history("jet-00")) >= 21, what="21 telemetry points")
    console.publish([status(console.prefix, "jet-00", "offline")])
    wait_until(
        lambda: console.view.device("jet-00").state == "offline",  # type: ignore[union-attr]
        what="jet-00 offline",
    )

    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    # uPlot's own scale of the chart (the page keeps its charts in a global ``charts``).
    low, high = page.evaluate("[charts.fps.scales.y.min, charts.fps.scales.y.max]")
    fps = page.locator("#facts dd .stale").first.inner_text()

    assert (low, high > 10.01 * 1.1) == (0, True)  # from 0: the jitter reads as a flat line
    assert fps.startswith("10.0 (stale: last heard ")
    assert "Temperatures (stale)" in page.inner_text("main")
    _screenshot(page, "console-device-offline.png")


def test_the_device_page_says_since_when_it_has_charts_and_decommissions_with_the_token(
    console: Console, page: Page
) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:2])))
    _arrived(console, 2)
    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    title = page.inner_text("#chart-fps h2")
    asked: list[str] = []

    def accept(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    page.click("#decommission")
    page.wait_for_selector("#token-box:not([hidden])")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("#message.ok")
    message = page.inner_text("#message")
    # The live stream removes the device: the page says the controller no longer knows it.
    page.wait_for_selector("#app > p.error", timeout=SHOWS_WITHIN_MS)

    # The console started a moment ago: the charts cannot hold the last hour, and say so.
    assert title.startswith("Frames per second (since ")
    assert title.endswith(", the controller's start)")
    assert len(asked) == 1
    assert asked[0].startswith("Decommission jet-00?")
    assert message == "device jet-00 decommissioned"
    assert "no device 'jet-00' heard by this controller" in page.inner_text("#app")
    assert console.view.device("jet-00") is None
    assert console.view.device("jet-01") is not None


def test_rollout_wave_counts_move_and_pause_needs_the_token(console: Console, page: Page) -> None:
    store = console.store
    console.publish(list(fleet_messages(console.prefix, DEVICES)))
    make_rollout(store, "r-2026-05", [DEVICES[:2], DEVICES[2:4], DEVICES[4:]])
    make_rollout(store, "r-earlier", [["old-1"]])
    store.set_state("r-earlier", RolloutState.ABORTED, "aborted by the operator")
    # Its rollback, as the controller's planner notes it (agent/fleet/rollout/rollback.py), done.
    store.note("r-earlier", "rollback", sha256="ab" * 32, devices=["old-1"], job_id="r-earlier-rb")
    store.note("r-earlier", "rollback_none", devices=[], why="no previous model in the slot")
    store.note("r-earlier", "rollback_done", ends={"old-1": "ACTIVE"})
    page.goto(console.server.url + "/rollouts")
    wave0 = page.locator('section[data-rollout="r-2026-05"] tr[data-wave="0"]')
    page.wait_for_selector('section[data-rollout="r-2026-05"] tr[data-wave="0"]')
    before = wave0.locator(".wave-steps").inner_text()

    # Wave 1: a canary rolled back by its probation; wave 2 ended and soaks.
    store.set_wave("r-2026-05", 0, WaveState.RUNNING)
    for device in DEVICES[:4]:
        store.mark_sending("r-2026-05", device)
        store.mark_sent("r-2026-05", device)
    store.record_job("r-2026-05", DEVICES[0], DeviceEnd.ACTIVE)
    failed = json.loads(failed_job(console.prefix, DEVICES[1])[1])
    store.record_job(
        "r-2026-05",
        DEVICES[1],
        DeviceEnd.ROLLED_BACK,
        {k: failed[k] for k in ("state", "error_code", "shadow", "probation")},
    )
    ends = {"ACTIVE": 1, "ROLLED_BACK": 1}
    store.set_wave("r-2026-05", 0, WaveState.DONE, figures=gate_figures(ends, limit=1))
    store.set_wave("r-2026-05", 1, WaveState.RUNNING)
    for device in DEVICES[2:4]:
        store.record_job("r-2026-05", device, DeviceEnd.ACTIVE)
    soaking = {**gate_figures({"ACTIVE": 3, "ROLLED_BACK": 1}, limit=1), "soak_until": time.time() + 600}
    store.set_wave("r-2026-05", 1, WaveState.SOAKING, figures=soaking, reason="soaking 600 s")
    rollout = 'section[data-rollout="r-2026-05"]'
    page.wait_for_selector(
        f'{rollout} tr[data-wave="0"] .wave-ends:text("ACTIVE 1, ROLLED_BACK 1")', timeout=SHOWS_WITHIN_MS
    )
    page.wait_for_selector(f'{rollout} tr[data-wave="1"] .soak-left', timeout=SHOWS_WITHIN_MS)
    gate = page.inner_text(f'{rollout} tr[data-wave="0"] .wave-gate')
    soak = page.inner_text(f'{rollout} tr[data-wave="1"] .soak')
    times = [page.inner_text(f'{rollout} tr[data-wave="{i}"] .wave-times') for i in range(3)]
    started = [
        time.strftime("%H:%M:%S", time.gmtime(w.started_at or 0)) for w in store.wave_rows("r-2026-05")
    ]
    page.click(f"{rollout} details.devices summary")
    rows = page.locator(f"{rollout} .device-rows tbody tr")
    expect(rows).to_have_count(len(DEVICES))
    first_row = rows.first.locator("td").all_inner_texts()
    device_rows = page.inner_text(f"{rollout} .device-rows")
    earlier = 'section[data-rollout="r-earlier"]'
    rolled_back = page.inner_text(f"{earlier} .rollback-outcome")
    heads = [page.inner_text(f"{r} .rollout-head .muted") for r in (rollout, earlier)]
    finished_boxes = (
        page.locator(f"{earlier} input.rollback").is_disabled(),
        page.locator(f"{earlier} button.abort").is_disabled(),
        page.locator(f"{rollout} input.rollback").is_disabled(),
    )
    _screenshot(page, "console-rollouts.png")

    assert before == "PLANNED 2"
    # Each wave's start and end (UTC) with how long it took; "since" while it runs; "-" before.
    assert re.fullmatch(rf"{started[0]}-\d\d:\d\d:\d\d \(\d+s\)", times[0]), times
    assert times[1:] == [f"since {started[1]}", "-"]
    assert gate == (
        "1 of 2 devices touched went wrong (0 failed, 1 rolled back, 0 unhealthy); the gate allows 1"
    )
    assert re.fullmatch(r"soaking: (10m|9m \d+s) left of 10m", soak), soak
    # The device that went wrong first: its wave (1-based), state, code and the figure that failed.
    # A probation that found the model unhealthy kept evidence frames: the row links to them.
    assert first_row == ["jet-01", "1", "ROLLED_BACK", "unhealthy", "p99_ms 130 crossed its bar 90", "frames"]
    assert "null" not in device_rows
    assert "undefined" not in device_rows
    assert rolled_back == "rollback: 1 device sent their previous model, 0 told to roll back (ACTIVE 1)"
    assert finished_boxes == (True, True, False)
    assert [h.split(", updated")[0] for h in heads] == ["slot main → 5, 8 devices", "slot main → 5, 1 device"]
    assert "ends={" not in page.inner_text("main")
    assert "soak_until" not in page.inner_text("main")

    pause = page.locator(f"{rollout} button.pause")
    assert page.locator("#token-box").is_hidden()  # asked for only when an action needs it
    pause.click()
    page.wait_for_selector("#token-box:not([hidden])")
    page.fill("#token-input", "not-the-token")
    page.click("#token-save")
    page.wait_for_selector("#message.error")
    refused = page.inner_text("#message")
    state_after_refusal = store.rollout("r-2026-05").state

    pause.click()
    page.wait_for_selector("#token-box:not([hidden])")  # the wrong token was forgotten: asked again
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("#message.ok")
    page.wait_for_selector(f'{rollout}[data-state="PAUSED"]', timeout=SHOWS_WITHIN_MS)

    assert refused == (
        "pause r-2026-05 refused (401): this token is not the console's: paste the content of the "
        "controller's http.token_file (the wrong one was forgotten; the next click asks again)"
    )
    assert state_after_refusal is RolloutState.RUNNING
    assert store.rollout("r-2026-05").state is RolloutState.PAUSED
    assert page.evaluate("sessionStorage.getItem('edge-agent-console-token')") == TOKEN
    assert page.locator(f"{earlier} .badge").first.inner_text() == "ABORTED"

    # Abort asks first: declined, nothing happens; confirmed, it aborts and rolls back.
    answers, asked = [False, True], []

    def answer(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.accept() if answers.pop(0) else dialog.dismiss()

    page.on("dialog", answer)
    page.locator(f"{rollout} input.rollback").check()
    page.click(f"{rollout} button.abort")
    page.wait_for_selector("#message:text('not done')")
    state_after_no = store.rollout("r-2026-05").state
    page.click(f"{rollout} button.abort")
    page.wait_for_selector(f'{rollout}[data-state="ABORTED"]', timeout=SHOWS_WITHIN_MS)

    assert state_after_no is RolloutState.PAUSED
    assert (
        asked
        == [
            "Abort rollout r-2026-05? Its waves not started yet are cancelled, and its 8 devices are "
            "moved back to their previous model."
        ]
        * 2
    )
    assert page.inner_text("#message") == "abort and roll back r-2026-05: aborted (rolling back)"
    assert page.locator(f"{rollout} input.rollback").is_disabled()


def test_a_console_without_a_token_refuses_actions_on_the_page(
    read_only_console: Console, page: Page
) -> None:
    make_rollout(read_only_console.store, "r-1", [DEVICES])
    page.goto(read_only_console.server.url + "/rollouts")
    page.click('section[data-rollout="r-1"] button.pause')
    page.click("#token-cancel")
    page.wait_for_selector("#message.error")
    cancelled = page.inner_text("#message")
    page.click('section[data-rollout="r-1"] button.pause')
    page.fill("#token-input", "anything")
    page.click("#token-save")
    page.wait_for_selector("#message.error:text('refused')")

    assert cancelled == (
        "no token given: paste the console token (the content of the controller's http.token_file) "
        "to pause r-1"
    )
    assert page.inner_text("#message") == (
        "pause r-1 refused (403): this console is read-only: the controller has no console token "
        "(set http.token_file in its controller.yaml to allow actions)"
    )
    assert read_only_console.store.rollout("r-1").state is RolloutState.RUNNING


def test_the_snapshot_button_draws_the_frame_with_its_boxes_and_labels(console: Console, page: Page) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:1])))
    _arrived(console, 1)
    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    page.fill("#snapshot-stream", "nope")
    page.click("#snapshot")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("#message.error")
    refused = page.inner_text("#message")
    page.fill("#snapshot-stream", "")
    page.click("#snapshot")  # the token is kept for the tab: no second prompt
    page.wait_for_selector("body[data-snapshot=drawn]")
    canvas = page.locator("#snapshot-canvas")
    # Pixels as drawn: the box's green outline, the white square inside it, the grey frame outside.
    x1, y1, x2, y2 = (int(v) for v in SNAPSHOT_BOX)
    probe = page.evaluate(
        """([points]) => {
            const g = document.querySelector("#snapshot-canvas").getContext("2d");
            return points.map(([x, y]) => Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3)));
        }""",
        [[[x1, (y1 + y2) // 2], [(x1 + x2) // 2, (y1 + y2) // 2], [20, y2 + 40]]],
    )

    assert "refused (409)" in refused
    assert "no stream 'nope'" in refused
    assert (canvas.get_attribute("width"), canvas.get_attribute("height")) == tuple(map(str, SNAPSHOT_SIZE))
    assert canvas.get_attribute("data-frame") == "12"
    assert canvas.get_attribute("data-labels") == "square"
    edge, inside, outside = probe
    assert edge[1] > 150 > edge[0]  # green: the box drawn from the result, at its source pixels
    assert min(inside) > 235  # the frame itself (JPEG: nearly white)
    assert all(50 < c < 70 for c in outside)
    assert "cam0 frame 12, 320x240" in page.inner_text("#snapshot-caption")


def test_a_drawn_snapshot_and_typed_fields_stay_while_telemetry_re_renders_the_page(
    console: Console, page: Page
) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:1])))
    _arrived(console, 1)
    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    page.click("#snapshot")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("body[data-snapshot=drawn]")
    page.fill("#snapshot-stream", "cam0")
    page.fill("#evidence-job", "job-typed")
    x1, y1, _, y2 = (int(v) for v in SNAPSHOT_BOX)
    green_at = """([x, y]) => document.querySelector("#snapshot-canvas").getContext("2d")
        .getImageData(x, y, 1, 1).data[1]"""
    shown = []
    # Each telemetry message re-renders the page (its fps figure shows it): the snapshot survives each.
    for fps in (31.0, 32.0, 33.0):
        page.evaluate("document.body.dataset.device = 'waiting'")
        console.publish([telemetry(console.prefix, "jet-00", fps=fps)])
        page.wait_for_selector("body[data-device=rendered]", timeout=SHOWS_WITHIN_MS)
        expect(page.locator("#facts")).to_contain_text(f"{fps:.1f}", timeout=SHOWS_WITHIN_MS)
        canvas = page.locator("#snapshot-canvas")
        shown.append(
            (
                canvas.is_visible(),
                canvas.get_attribute("data-frame"),
                page.evaluate(green_at, [x1, (y1 + y2) // 2]) > 150,
                page.input_value("#snapshot-stream"),
                page.input_value("#evidence-job"),
                page.evaluate("document.activeElement.id"),
                "cam0 frame 12" in page.inner_text("#snapshot-caption"),
            )
        )

    assert shown == [(True, "12", True, "cam0", "job-typed", "evidence-job", True)] * 3


def _screenshot(page: Page, name: str) -> None:
    """Take a screenshot for the docs (see the module docstring), once the live indicator has settled."""
    if os.environ.get("EDGE_AGENT_SCREENSHOTS") == "1":
        folder = DOCS_IMG
        folder.mkdir(parents=True, exist_ok=True)
    else:  # a folder of its own: runs and xdist workers side by side never write one file
        folder = Path(tempfile.mkdtemp(prefix="console-shot-"))
    time.sleep(0.2)  # let uPlot finish its first draw (it draws on the next animation frame)
    page.screenshot(path=str(folder / name), full_page=True)
    assert (folder / name).stat().st_size > 10_000  # a rendered page, not an empty frame
    if folder != DOCS_IMG:
        shutil.rmtree(folder)


def test_the_evidence_panel_shows_a_rejected_jobs_frames_side_by_side(console: Console, page: Page) -> None:
    console.publish(list(fleet_messages(console.prefix, DEVICES[:1])))
    _arrived(console, 1)
    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    page.fill("#evidence-job", "job-swapped")
    page.click("#evidence")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("body[data-evidence=shown]")
    rows = page.locator("#evidence-table tr.evidence-frame")
    serving = page.locator("#evidence-table td.serving").all_inner_texts()
    candidate = page.locator("#evidence-table td.candidate").all_inner_texts()
    # Every frame's image decoded in the browser (a broken JPEG has naturalWidth 0).
    widths = page.evaluate(
        "() => Array.from(document.querySelectorAll('#evidence-table img')).map((i) => i.naturalWidth)"
    )
    _screenshot(page, "console-evidence.png")

    assert rows.count() == len(EVIDENCE_CLASSES)
    assert [s.split()[0] for s in serving] == [old for old, _ in EVIDENCE_CLASSES]
    assert [c.split()[0] for c in candidate] == [new for _, new in EVIDENCE_CLASSES]
    assert widths == [160] * len(EVIDENCE_CLASSES)
    assert "shadow_disagrees" in page.inner_text("#evidence-frames")


def test_a_rollouts_shadow_rejection_links_to_its_evidence(console: Console, page: Page) -> None:
    store = console.store
    console.publish(list(fleet_messages(console.prefix, DEVICES[:2])))
    _arrived(console, 2)
    make_rollout(store, "r-swap", [DEVICES[:2]])
    store.set_wave("r-swap", 0, WaveState.RUNNING)
    for device in DEVICES[:2]:
        store.mark_sending("r-swap", device)
        store.mark_sent("r-swap", device)
    store.record_job("r-swap", DEVICES[0], DeviceEnd.ACTIVE)
    store.record_job(
        "r-swap", DEVICES[1], DeviceEnd.REJECTED, {"state": "REJECTED", "error_code": "shadow_disagrees"}
    )
    page.goto(console.server.url + "/rollouts")
    rollout = 'section[data-rollout="r-swap"]'
    page.wait_for_selector(rollout)
    page.click(f"{rollout} details.devices summary")
    link = page.locator(f"{rollout} .device-rows a.evidence-link")
    expect(link).to_have_count(1)  # the rejected device only, not the one that went ACTIVE
    link.click()
    page.wait_for_selector("body[data-device=rendered]")
    job = page.input_value("#evidence-job")
    page.click("#evidence")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    page.wait_for_selector("body[data-evidence=shown]")

    assert page.url.endswith(f"/device/{DEVICES[1]}?evidence=job-r-swap")
    assert job == "job-r-swap"
    assert page.locator("#evidence-table tr.evidence-frame").count() == len(EVIDENCE_CLASSES)
