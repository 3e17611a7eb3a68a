"""A real Prometheus scrapes the controller's /metrics while simulated devices publish through a
real broker: PromQL through its HTTP API sees each device's series with the right values and labels,
and a device that stops publishing goes stale instead of freezing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from tests.fleet.metrics.scraped_fleet import ScrapedFleet
from tests.waiting import wait_until

SITES = {"jet-a": "lab", "jet-b": "yard", "jet-c": "yard"}


@pytest.fixture
def fleet(broker: Broker, tmp_path: Path) -> Iterator[ScrapedFleet]:
    scraped = ScrapedFleet(broker, tmp_path, SITES)
    yield scraped
    scraped.close()


def values(fleet: ScrapedFleet, promql: str) -> dict[str, float]:
    """The query's samples by their ``device`` label."""
    return {r["metric"].get("device", ""): float(r["value"][1]) for r in fleet.prometheus.query(promql)}


def test_device_series_arrive_with_values_and_labels_and_go_stale(fleet: ScrapedFleet) -> None:
    wait_until(
        lambda: len(values(fleet, "edge_stream_frames_per_second")) == 3,
        timeout=30,
        what="fps of 3 devices scraped",
    )
    assert values(fleet, "edge_stream_frames_per_second") == {"jet-a": 20.0, "jet-b": 21.0, "jet-c": 22.0}
    [p99] = fleet.prometheus.query(
        'edge_stream_latency_seconds{device="jet-b",stage="total",quantile="0.99"}'
    )
    assert p99["metric"]["stream"] == "cam0"
    assert p99["metric"]["job"] == "edge"  # Prometheus's own target label sits beside ours
    assert float(p99["value"][1]) == pytest.approx(0.016)
    # The info metric joins the device's labels onto any series.
    by_site = fleet.prometheus.query(
        "sum by (site) (edge_stream_frames_per_second * on(device) group_left(site) edge_device_info)"
    )
    assert {r["metric"]["site"]: float(r["value"][1]) for r in by_site} == {"lab": 20.0, "yard": 43.0}
    assert values(fleet, 'edge_temperature_celsius{zone="cpu_therm"}') == {
        "jet-a": 50.0,
        "jet-b": 51.0,
        "jet-c": 52.0,
    }
    assert values(fleet, 'edge_clock_hertz{clock="dla0"}')["jet-a"] == 1.6e9
    assert values(fleet, 'edge_slot_model_info{slot="main"}') == {"jet-a": 1.0, "jet-b": 1.0, "jet-c": 1.0}
    assert values(fleet, "edge_device_online") == {"jet-a": 1.0, "jet-b": 1.0, "jet-c": 1.0}

    # jet-b goes silent (still "online": a hung agent or a cut link without a Last Will yet);
    # jet-c stops gracefully (offline).
    fleet.devices["jet-b"].publishing = False
    fleet.devices["jet-c"].go_offline()
    wait_until(
        lambda: set(values(fleet, "edge_stream_frames_per_second")) == {"jet-a"},
        timeout=30,
        what="the silent and the offline device's fps to go stale",
    )
    assert set(values(fleet, "edge_temperature_celsius")) == {"jet-a"}
    assert values(fleet, "edge_device_online") == {"jet-a": 1.0, "jet-b": 1.0, "jet-c": 0.0}
    assert values(fleet, "edge_device_stale") == {"jet-a": 0.0, "jet-b": 1.0, "jet-c": 1.0}
    # Not frozen: the last value is not returned for an instant query after the staleness marker.
    assert values(fleet, 'edge_stream_frames_per_second{device="jet-b"}') == {}


def test_rollout_series_are_scraped(fleet: ScrapedFleet) -> None:
    wait_until(lambda: bool(fleet.prometheus.query("edge_rollout_info")), timeout=30, what="rollout series")
    [info] = fleet.prometheus.query("edge_rollout_info")
    assert (info["metric"]["rollout_id"], info["metric"]["state"], info["metric"]["to_version"]) == (
        "r-1",
        "RUNNING",
        "5",
    )
    planned = fleet.prometheus.query('sum by (wave) (edge_rollout_devices{rollout_id="r-1",step="PLANNED"})')
    # waves counted from 1, as the CLI and the console count them (issue 22.6)
    assert {r["metric"]["wave"]: float(r["value"][1]) for r in planned} == {"1": 1.0, "2": 2.0}
