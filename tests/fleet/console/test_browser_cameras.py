"""The device page's cameras and its charts' time axis, in a real headless Chromium.

As test_browser.py (whose Chromium and console fixtures these tests share): simulated devices publish
protocol messages to a real mosquitto, uvicorn serves the console, Chromium renders the page.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page

from agent.demo.broker import Broker
from tests.fleet.console import test_browser, test_browser_figures
from tests.fleet.console.test_browser import TOKEN, Console, _serve
from tests.fleet.console_rig import DOCK_ERROR, fleet_messages, telemetry
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

#: test_browser.py's Chromium, one per module, and test_browser_figures.py's page (a script error
#: fails the test).
browser = test_browser.browser
page = test_browser_figures.page


@pytest.fixture
def console(broker: Broker, tmp_path: Path) -> Iterator[Console]:
    yield from _serve(broker, tmp_path, TOKEN)


def _one_device(console: Console) -> None:
    """jet-00's status, info (camera cam0 streaming, dock reconnecting) and one telemetry point, heard."""
    console.publish(list(fleet_messages(console.prefix, ["jet-00"])))
    wait_until(lambda: len(console.view.history("jet-00")) == 1, what="one telemetry point")


def _device_page(console: Console, page: Page) -> None:
    page.goto(console.server.url + "/device/jet-00")
    page.wait_for_selector("body[data-device=rendered]")


def _x_axis(page: Page) -> tuple[float, float]:
    low, high = page.evaluate("[charts.fps.scales.x.min, charts.fps.scales.x.max]")
    return float(low), float(high)


def test_one_telemetry_point_is_charted_in_a_minute_around_it(console: Console, page: Page) -> None:
    _one_device(console)
    point = console.view.history("jet-00")[0].ts

    _device_page(console, page)
    low, high = _x_axis(page)

    # uPlot's own range for a single point spans years (min equal to max widened by magnitude).
    assert (high - low, low < point < high) == (60.0, True)


def test_a_few_points_span_what_was_received_and_a_long_history_its_own_span(
    console: Console, page: Page
) -> None:
    console.publish(list(fleet_messages(console.prefix, ["jet-00"])))
    for fps in (24.0, 25.0):
        console.publish([telemetry(console.prefix, "jet-00", fps=fps)])
    wait_until(lambda: len(console.view.history("jet-00")) == 3, what="three telemetry points")
    points = [p.ts for p in console.view.history("jet-00")]

    _device_page(console, page)
    low, high = _x_axis(page)
    # The same rule over a history longer than the minimum: the axis is exactly what was received.
    long_span = page.evaluate("timeRange(null, 1000, 1300)")
    none_yet = page.evaluate("(() => { const [a, b] = timeRange(null, null, null); return b - a; })()")

    assert high - low == 60.0
    assert low < min(points)
    assert max(points) < high
    assert long_span == [1000, 1300]
    assert none_yet == 60


def test_the_device_page_lists_each_camera_with_its_state_figures_and_last_error(
    console: Console, page: Page
) -> None:
    _one_device(console)

    _device_page(console, page)
    # Cell by cell: a row's innerText has tabs between cells only once the table is laid out.
    table_rows = page.locator("#cameras tbody tr")
    rows = [table_rows.nth(i).locator("td").all_inner_texts() for i in range(table_rows.count())]
    down = page.locator("#cameras tr.down td:first-child").all_inner_texts()

    assert len(rows) == 2
    cam0 = rows[0]
    assert cam0[0] == "cam0"
    assert cam0[1].startswith("streaming for 1h")
    assert cam0[2:5] == ["25.0", "0s ago", "0"]
    dock = rows[1]
    assert dock[0] == "dock"
    assert dock[1].startswith("reconnecting for 2m")
    assert dock[2:5] == ["0.0", "2m 12s ago", "14"]
    assert dock[5].startswith(DOCK_ERROR + " (2m")
    assert down == ["dock"]


def test_the_devices_table_counts_each_devices_cameras_and_the_ones_down(
    console: Console, page: Page
) -> None:
    _one_device(console)

    page.goto(console.server.url + "/")
    page.wait_for_selector('#devices tr[data-device="jet-00"]')
    cell = page.locator('#devices tr[data-device="jet-00"] td.cameras')

    assert cell.inner_text() == "1 of 2 down"
    assert "error" in (cell.get_attribute("class") or "")
