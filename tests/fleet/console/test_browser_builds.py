"""The console's engines page and the builds on its rollouts page, in a real headless Chromium.

As in test_browser.py (whose Chromium, page and screenshot fixtures these tests share): devices
publish protocol messages to a real mosquitto, a service client feeds them into a FleetView, rollout
transitions go to a real RolloutStore file, uvicorn serves the console. The engines come from a real
controller engine desk (store on disk, trust checks, signing with an operator key), filled through
the requests a device sends (offer, piece) and withdrawn through the store's own call.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from agent.demo.broker import Broker
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.hooks import engines_listing
from agent.fleet.rollout.records import WaveState
from agent.protocol.engines import EngineAsk
from agent.protocol.messages import BuildProgressInfo, JobState, JobStatus, encode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.console import test_browser
from tests.fleet.console.test_browser import SHOWS_WITHIN_MS, TOKEN, Console, _screenshot, _serve
from tests.fleet.console_rig import fleet_messages, make_rollout
from tests.fleet.engines.records import offer, store_engine
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

#: A fingerprint as a hostile device could send it: markup and a bidi override.
HOSTILE_FINGERPRINT = '<img src=x onerror="document.body.dataset.pwned=1">\u202etrt 10.3'


#: test_browser.py's fixtures: one Chromium per module, a page that fails the test on a script error.
browser = test_browser.browser
page = test_browser.page


@pytest.fixture
def desk(tmp_path: Path) -> EngineDesk:
    return make_desk(tmp_path / "engines", Ed25519PrivateKey.generate(), key_id="ops-2026")


@pytest.fixture
def console(broker: Broker, tmp_path: Path, desk: EngineDesk) -> Iterator[Console]:
    yield from _serve(broker, tmp_path, TOKEN, engines=lambda: engines_listing(desk))


def test_the_engines_page_lists_each_fingerprints_engines_with_builder_build_time_and_reuse(
    console: Console, desk: EngineDesk, page: Page
) -> None:
    cpu = "onnxruntime 1.20 / x86_64 / cpu"
    int8 = {**offer().meta, "identity": {"precision": "int8"}}
    shared = store_engine(
        desk,
        "jet-01",
        b"int8 engine of cls v2" * 50,
        fingerprint=cpu,
        build_seconds=41.5,
        model_id="cls",
        version="2",
        meta=int8,
    ).key
    for device in ("jet-02", "jet-03", "jet-01"):  # two downloads by others; the builder's own is no reuse
        desk.store.used(shared, device)
    hostile = store_engine(
        desk, "jet-04", b"fp16 engine" * 10, fingerprint=HOSTILE_FINGERPRINT, build_seconds=312.0
    ).key
    bad = store_engine(
        desk, "jet-05", b"an engine that failed to load", fingerprint=cpu, build_seconds=3.0
    ).key
    assert desk.store.withdraw(bad, "failed to load on jet-06")
    # A key nobody holds: the first asker builds it under its claim, the next two wait for it.
    ask = EngineAsk(
        key="ab" * 32,
        job_id="cls-3",
        fingerprint="onnxruntime 1.20 / x86_64 / cpu",
        model_id="cls",
        version="3",
        precision="fp16",
    )
    for device in ("jet-08", "jet-09", "jet-10"):
        desk.handle(device, "ask", ask.model_dump_json().encode(), {})

    page.goto(console.server.url + "/engines")
    page.wait_for_selector("#engines[data-rendered='1']")
    headings = page.locator("#engines section.fingerprint h2").all_inner_texts()
    rows = {
        key: page.locator(f'#engines tr[data-key="{key}"] td').all_inner_texts() for key in (shared, hostile)
    }
    withdrawn = page.locator("#withdrawn tbody tr").all_inner_texts()
    claim = page.locator(f'#claims tr[data-key="{"ab" * 32}"] td').all_inner_texts()
    totals = page.inner_text("#engines p.totals")
    nav = page.locator("#nav-engines").get_attribute("class")
    api = json.loads(page.request.get(console.server.url + "/api/engines").text())
    _screenshot(page, "console-engines.png")

    # A new engine shows on the open page at its next read (every 5 s).
    later = store_engine(desk, "jet-07", b"a later engine" * 20, fingerprint=cpu, build_seconds=7.0).key
    expect(page.locator(f'#engines tr[data-key="{later}"]')).to_have_count(1, timeout=3 * SHOWS_WITHIN_MS)

    shown_hostile = HOSTILE_FINGERPRINT.replace("\u202e", "\\u202e")
    assert headings == sorted([cpu, shown_hostile])
    # Each key's model, version and precision, then its size and builder.
    assert rows[shared][:6] == [shared[:12], "cls", "2", "int8", "1.0 KiB", "jet-01"]
    assert rows[shared][7:9] == ["42s", "2"]  # build seconds, downloads by devices other than the builder
    assert rows[hostile][1:4] == ["-", "-", "-"]  # its builder named no model
    assert rows[hostile][5] == "jet-04"
    assert rows[hostile][7] == "5m 12s"
    assert page.locator("main img").count() == 0
    assert page.evaluate("document.body.dataset.pwned") is None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(api["withdrawn"][0]["at"]))
    assert withdrawn == [
        f"{bad[:12]}\twithdrawn\t{hashlib.sha256(b'an engine that failed to load').hexdigest()[:12]}"
        f"\tjet-05\t{cpu}\t{when}\tfailed to load on jet-06"
    ]
    assert claim[:6] == ["ab" * 6, "cls", "3", "fp16", "onnxruntime 1.20 / x86_64 / cpu", "jet-08"]
    assert claim[8] == "2", "two devices wait for the claimed build"
    assert totals.startswith("2 engines (")
    assert "sharing on" in totals
    assert "current" in (nav or "")
    # The page reads the controller's own listing: the `engines` verb's answer, same field names.
    assert api["fingerprints"][cpu][0]["built_by"] == "jet-01"
    assert api["fingerprints"][cpu][0]["reuse"] == 2
    assert api["withdrawn_total"] == 1


def building(
    prefix: str, device: str, job_id: str, state: JobState, build: BuildProgressInfo | None
) -> tuple[str, bytes]:
    """A device's job status while its engine builds.

    ``build`` is what agent.engines.building.progress sends.
    """
    message = JobStatus(job_id=job_id, slot="main", state=state, progress=0.3, build=build)
    return Topics(prefix, device).jobs(job_id), encode(message)


def test_the_rollouts_page_shows_each_building_devices_phase_frames_elapsed_and_estimate(
    console: Console, page: Page
) -> None:
    devices = ["jet-00", "jet-01", "jet-02"]
    console.publish(list(fleet_messages(console.prefix, devices)))
    wait_until(lambda: len(console.view.devices()) == 3, what="3 devices in the view")
    store = console.store
    make_rollout(store, "r-int8", [devices])
    store.set_wave("r-int8", 0, WaveState.RUNNING, reason="started")
    for device in devices:
        store.mark_sending("r-int8", device)
        store.mark_sent("r-int8", device)
    job = "job-r-int8"
    calibrating = BuildProgressInfo(
        phase="calibrating", frames_done=120, frames_total=500, elapsed_s=42.0, estimate_s=310.0
    )
    console.publish(
        [
            building(console.prefix, "jet-00", job, JobState.BUILDING, calibrating),
            building(
                console.prefix,
                "jet-01",
                job,
                JobState.BUILDING,
                BuildProgressInfo(phase="slimming", elapsed_s=4.0),
            ),
            building(console.prefix, "jet-02", job, JobState.DOWNLOADING, None),
        ]
    )
    rollout = 'section[data-rollout="r-int8"]'
    page.goto(console.server.url + "/rollouts")
    page.wait_for_selector(f'{rollout} .building tr[data-device="jet-01"]', timeout=SHOWS_WITHIN_MS)
    rows = page.locator(f"{rollout} .building tbody tr").all_inner_texts()
    head = page.inner_text(f"{rollout} .building-head")
    _screenshot(page, "console-rollouts-building.png")

    later = calibrating.model_copy(update={"frames_done": 480, "elapsed_s": 160.0})
    console.publish([building(console.prefix, "jet-00", job, JobState.BUILDING, later)])
    expect(page.locator(f'{rollout} .building tr[data-device="jet-00"] .build-note')).to_have_text(
        "calibrating 480/500 frames, 160 s of ~310 s", timeout=SHOWS_WITHIN_MS
    )
    console.publish([building(console.prefix, "jet-00", job, JobState.VALIDATING, None)])
    expect(page.locator(f"{rollout} .building tbody tr")).to_have_count(1, timeout=SHOWS_WITHIN_MS)
    still = page.inner_text(f"{rollout} .building tbody tr")
    # The device page says it too, on the job's row.
    page.goto(console.server.url + "/device/jet-01")
    page.wait_for_selector("body[data-device=rendered]")
    job_row = page.locator("#jobs tbody tr").first.inner_text()

    assert head == "2 devices building the engine:"
    assert rows == [
        "jet-00\t1\tcalibrating 120/500 frames, 42 s of ~310 s",
        "jet-01\t1\tslimming, 4 s",
    ]
    assert still == "jet-01\t1\tslimming, 4 s"  # jet-00 left BUILDING: its row went with it
    assert job_row.split("\t")[:3] == ["job-r-int8", "main", "BUILDING slimming, 4 s"]


@pytest.fixture
def waiting_console(broker: Broker, tmp_path: Path, desk: EngineDesk) -> Iterator[Console]:
    """A console told who waits for whose build by the engine desk's claims, as the controller does."""
    yield from _serve(broker, tmp_path, TOKEN, waits=lambda: desk.claims.waiting(time.monotonic()))


def test_a_device_waiting_for_another_devices_build_says_whose_and_how_long(
    waiting_console: Console, desk: EngineDesk, page: Page
) -> None:
    """Not "planning": the rollouts page names the device whose build (a claim at the controller's
    real engine desk) the waiting device waits for, and how long it has waited."""
    console = waiting_console
    ask = EngineAsk(key="ef" * 32, job_id="job-r-wait", model_id="cls", version="5", precision="int8")
    assert desk.handle("jet-07", "ask", ask.model_dump_json().encode(), {})["build"] is True
    assert desk.handle("jet-00", "ask", ask.model_dump_json().encode(), {})["build"] is False
    console.publish(list(fleet_messages(console.prefix, ["jet-00"])))
    wait_until(lambda: len(console.view.devices()) == 1, what="the device in the view")
    make_rollout(console.store, "r-wait", [["jet-00"]])
    console.store.set_wave("r-wait", 0, WaveState.RUNNING, reason="started")
    console.store.mark_sending("r-wait", "jet-00")
    console.store.mark_sent("r-wait", "jet-00")
    planning = BuildProgressInfo(phase="planning", elapsed_s=35.0)
    console.publish([building(console.prefix, "jet-00", "job-r-wait", JobState.BUILDING, planning)])
    page.goto(console.server.url + "/rollouts")
    note = page.locator('section[data-rollout="r-wait"] .building tr[data-device="jet-00"] .build-note')
    expect(note).to_have_text(re.compile(r"waiting for jet-07's build, \d+ s"), timeout=SHOWS_WITHIN_MS)
    api = json.loads(page.request.get(console.server.url + "/api/rollout/r-wait").text())
    (entry,) = api["building"]
    assert entry["waiting_for"] == "jet-07"
    assert entry["waited_s"] >= 0
    assert entry["phase"] == "planning"
