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

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright

from agent.fleet.console import make_console_app, serve_console
from agent.fleet.console.server import ConsoleServer
from agent.fleet.gate import DeviceEnd
from agent.fleet.rollout_store import RolloutState, RolloutStore, WaveState
from agent.fleet.view import FleetView
from agent.localbroker import Broker
from agent.mqtt.service_client import ServiceClient
from tests.fleet.console_rig import (
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
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
TOKEN = "console-test-token"
DEVICES = [f"jet-{i:02d}" for i in range(8)]
#: How long the page may take to show a change (the feed sends at most one frame a second).
SHOWS_WITHIN_MS = 5000


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


def _serve(broker: Broker, tmp_path: Path, token: str | None) -> Iterator[Console]:
    prefix = unique_prefix()
    view = FleetView(prefix)
    store = new_store(tmp_path)
    client = ServiceClient(operator_settings(broker, prefix), handler=view.apply)
    client.start()
    for topic_filter in view.topic_filters():
        client.subscribe(topic_filter, qos=1)
    server = serve_console(
        make_console_app(view, store, StoreActions(store, view), token=token), "127.0.0.1", 0
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
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    # Chromium logs each 4xx answer as an error; the refused actions answer 401/403 on purpose.
    p.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" and "status of 40" not in m.text else None,
    )
    yield p
    context.close()
    # A script error or a refused resource (CSP) would show here: the page must run clean.
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
    assert "expected ',' or ')'" in page.inner_text("#filter-error")


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
    assert "agreement=0.97" in verdicts
    assert "elapsed_s=30" in verdicts
    _screenshot(page, "console-device.png")

    console.publish([status(console.prefix, "jet-00", "offline")])
    page.wait_for_selector("#device-title .badge.offline", timeout=SHOWS_WITHIN_MS)


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
    page.goto(console.server.url + "/rollouts")
    wave0 = page.locator('section[data-rollout="r-2026-05"] tr[data-wave="0"]')
    page.wait_for_selector('section[data-rollout="r-2026-05"] tr[data-wave="0"]')
    before = wave0.locator(".wave-steps").inner_text()

    store.set_wave("r-2026-05", 0, WaveState.RUNNING)
    for device in DEVICES[:2]:
        store.mark_sending("r-2026-05", device)
        store.mark_sent("r-2026-05", device)
    store.record_job("r-2026-05", DEVICES[0], DeviceEnd.ACTIVE)
    store.record_job("r-2026-05", DEVICES[1], DeviceEnd.ACTIVE)
    store.set_wave("r-2026-05", 0, WaveState.DONE, figures=gate_figures({"ACTIVE": 2}))
    store.set_wave("r-2026-05", 1, WaveState.RUNNING)
    store.mark_sending("r-2026-05", DEVICES[2])
    rollout = 'section[data-rollout="r-2026-05"]'
    page.wait_for_selector(
        f'{rollout} tr[data-wave="0"] .wave-ends:text("ACTIVE 2")', timeout=SHOWS_WITHIN_MS
    )
    page.wait_for_selector(f'{rollout} tr[data-wave="1"] .wave-steps:text("SENDING 1")')
    _screenshot(page, "console-rollouts.png")

    pause = page.locator('section[data-rollout="r-2026-05"] button.pause')
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
    page.wait_for_selector('section[data-rollout="r-2026-05"][data-state="PAUSED"]', timeout=SHOWS_WITHIN_MS)

    assert before == "PLANNED 2"
    assert "refused (401)" in refused
    assert state_after_refusal is RolloutState.RUNNING
    assert store.rollout("r-2026-05").state is RolloutState.PAUSED
    assert page.evaluate("sessionStorage.getItem('edge-agent-console-token')") == TOKEN
    assert page.locator('section[data-rollout="r-earlier"] .badge').first.inner_text() == "ABORTED"


def test_a_console_without_a_token_refuses_actions_on_the_page(
    read_only_console: Console, page: Page
) -> None:
    make_rollout(read_only_console.store, "r-1", [DEVICES])
    page.goto(read_only_console.server.url + "/rollouts")
    page.click('section[data-rollout="r-1"] button.pause')
    page.fill("#token-input", "anything")
    page.click("#token-save")
    page.wait_for_selector("#message.error")

    assert "refused (403): actions are disabled" in page.inner_text("#message")
    assert read_only_console.store.rollout("r-1").state is RolloutState.RUNNING


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
