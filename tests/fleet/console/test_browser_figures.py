"""How the console writes figures and times, in a real headless Chromium: device figures rounded
as a person reads them, chart legends that show the latest point instead of ``--``, and the
Engines page's times all in UTC (as ``fleet engines list`` writes them) whatever the browser's zone.

As test_browser.py (whose Chromium and console fixtures these tests share): devices publish protocol
messages to a real mosquitto, uvicorn serves the console, the engines come from a real controller
engine desk. The page runs in a browser whose time zone is Asia/Kolkata (UTC+05:30), so a local
time cannot pass for UTC.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page

from agent.demo.broker import Broker
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.hooks import engines_listing
from agent.protocol.messages import JobState, JobStatus, ProbationFigures, ShadowFigures, encode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.console import test_browser
from tests.fleet.console.test_browser import TOKEN, Console, _serve
from tests.fleet.console_rig import fleet_messages, telemetry
from tests.fleet.engines.records import store_engine
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]

#: test_browser.py's Chromium, one per module.
browser = test_browser.browser


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a browser half an hour off any whole-hour zone; a script error fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, timezone_id="Asia/Kolkata")
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    yield p
    context.close()
    assert errors == []


@pytest.fixture
def desk(tmp_path: Path) -> EngineDesk:
    return make_desk(tmp_path / "engines", Ed25519PrivateKey.generate(), key_id="ops-2026")


@pytest.fixture
def console(broker: Broker, tmp_path: Path, desk: EngineDesk) -> Iterator[Console]:
    yield from _serve(broker, tmp_path, TOKEN, engines=lambda: engines_listing(desk))


def test_device_figures_are_rounded_and_chart_legends_show_the_latest_point(
    console: Console, page: Page
) -> None:
    console.publish(list(fleet_messages(console.prefix, ["jet-00"])))
    for fps in (24.0, 25.0, 26.25):
        console.publish([telemetry(console.prefix, "jet-00", fps=fps)])
    job = JobStatus(
        job_id="job-7",
        slot="main",
        state=JobState.ACTIVE,
        shadow=ShadowFigures(frames=120, agreement=0.97341, latency_ratio=0.9096),
        probation=ProbationFigures(
            elapsed_s=60.0, probation_s=60.0, baseline={"p99_ms": 41.537}, current={"p99_ms": 39.0012}
        ),
    )
    console.publish([(Topics(console.prefix, "jet-00").jobs("job-7"), encode(job))])
    wait_until(lambda: len(console.view.history("jet-00")) >= 4, what="4 telemetry points")
    wait_until(lambda: bool(console.view.device("jet-00").jobs), what="the job status")  # type: ignore[union-attr]

    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")
    verdicts = page.inner_text("#verdicts")
    figures = page.locator("#verdicts table.figures tbody tr").all_inner_texts()
    fps_legend = page.inner_text("#chart-fps .u-legend")
    latency_legend = page.inner_text("#chart-latency .u-legend")

    assert "120 frames, agreement 0.973, latency x0.91" in verdicts
    assert figures == ["p99_ms\t41.54\t39"]
    assert "--" not in fps_legend + latency_legend, (fps_legend, latency_legend)
    assert "26.3" in fps_legend  # the latest fps, as the facts write figures
    assert "(latest)" in fps_legend


def test_the_engines_page_writes_every_time_in_utc(console: Console, desk: EngineDesk, page: Page) -> None:
    cpu = "onnxruntime 1.20 / x86_64 / cpu"
    kept = store_engine(desk, "jet-01", b"an engine" * 40, fingerprint=cpu, build_seconds=4.0)
    bad = store_engine(desk, "jet-02", b"a bad engine" * 40, fingerprint=cpu, build_seconds=4.0).key
    assert desk.store.withdraw(bad, "failed to load on jet-03")

    page.goto(console.server.url + "/engines")
    page.wait_for_selector("#engines[data-rendered='1']")
    headers = page.locator("#engines section.fingerprint th").all_text_contents()
    built_at = page.inner_text(f'#engines tr[data-key="{kept.key}"] td.built-at')
    withdrawn_headers = page.locator("#withdrawn th").all_text_contents()

    assert "built at (UTC)" in headers
    assert built_at == time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(kept.built_at))
    assert "withdrawn (UTC)" in withdrawn_headers
    # docs/console.md says what the page keeps of a withdrawn engine: each column, in its words.
    doc = " ".join((REPO / "docs" / "console.md").read_text(encoding="utf-8").split())
    said = doc.split("then the engines withdrawn because a device found them bad (", 1)[1].split(")", 1)[0]
    words = {
        "key": "key",
        "engine sha256": "engine SHA-256",
        "built by": "the device that built it",
        "fingerprint": "its fingerprint",
        "withdrawn (UTC)": "when it was withdrawn",
        "why": "why",
    }
    assert [h for h in withdrawn_headers if h != "state"] == list(words)
    assert all(w in said for w in words.values()), said
