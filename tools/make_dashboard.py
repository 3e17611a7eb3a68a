"""Generate dashboards/edge-fleet.json, the Grafana dashboard of the fleet, with grafana-foundation-sdk.

    python tools/make_dashboard.py            # writes dashboards/edge-fleet.json
    python tools/make_dashboard.py --check    # exit 1 when the committed file differs

The panels and their PromQL live in :data:`OVERVIEW` and :data:`DEVICE` (plain data), so the tests
run every query against a real Prometheus (tests/fleet/metrics/test_dashboard.py) and check the
committed JSON is what this script makes. Series names: agent/fleet/metrics/exposition.py,
agent/fleet/metrics/device_series.py and agent/telemetry/series.py. ``$site`` filters the overview
through the ``edge_device_info`` join; ``$device`` picks the device of the drill-down rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).resolve().parents[1] / "dashboards" / "edge-fleet.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Joins the device's site onto a per-device series and keeps the sites picked in ``$site``.
IN_SITE = '* on(device) group_left(site) edge_device_info{site=~"$site"}'
DROP_RATE = "rate(edge_stream_dropped_frames_total[$__rate_interval])"


@dataclass(frozen=True)
class Panel:
    """One panel: its title, kind, unit and queries (expr, legend)."""

    title: str
    kind: Literal["stat", "timeseries", "table"]
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"
    width: int = 8


OVERVIEW: tuple[Panel, ...] = (
    Panel("Online devices", "stat", ((f"sum(edge_device_online {IN_SITE})", "online"),), width=4),
    Panel("Stale or offline devices", "stat", ((f"sum(edge_device_stale {IN_SITE})", "stale"),), width=4),
    Panel(
        "Model versions by slot",
        "table",
        (
            (
                f"count by (slot, model_id, version) (edge_slot_model_info {IN_SITE})",
                "{{slot}} {{model_id}}:{{version}}",
            ),
        ),
        width=8,
    ),
    Panel(
        "Rollout progress (devices by job end)",
        "table",
        (
            (
                "sum by (rollout_id, wave, step, end) (edge_rollout_devices)",
                "{{rollout_id}} wave {{wave}} {{step}} {{end}}",
            ),
            ("edge_rollout_info", "{{rollout_id}} {{slot}} -> {{to_version}} {{state}}"),
        ),
        width=8,
    ),
    Panel(
        "Frames per second by device",
        "timeseries",
        ((f"sum by (device) (edge_stream_frames_per_second {IN_SITE})", "{{device}}"),),
    ),
    Panel(
        "p99 latency by device",
        "timeseries",
        (
            (
                f'max by (device) (edge_stream_latency_seconds{{stage="total",quantile="0.99"}} {IN_SITE})',
                "{{device}}",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Dropped frames by reason",
        "timeseries",
        (
            (
                f"sum by (device, reason) ({DROP_RATE} {IN_SITE})",
                "{{device}} {{reason}}",
            ),
        ),
        unit="short",
    ),
    Panel(
        "Hottest zone by device",
        "timeseries",
        ((f"max by (device) (edge_temperature_celsius {IN_SITE})", "{{device}}"),),
        unit="celsius",
    ),
    Panel(
        "Clocks (a drop under load is throttling)",
        "timeseries",
        ((f"max by (device, clock) (edge_clock_hertz {IN_SITE})", "{{device}} {{clock}}"),),
        unit="hertz",
    ),
    Panel("Devices by state", "timeseries", (("edge_fleet_devices", "{{state}}"),)),
)

DEVICE: tuple[Panel, ...] = (
    Panel(
        "Slots and models",
        "table",
        (('edge_slot_model_info{device="$device"}', "{{slot}} {{model_id}}:{{version}} {{state}}"),),
        width=12,
    ),
    Panel(
        "Last job per slot",
        "table",
        (('edge_slot_job_info{device="$device"}', "{{slot}} {{job_id}} {{state}} {{error_code}}"),),
        width=12,
    ),
    Panel(
        "Frames per second",
        "timeseries",
        (('edge_stream_frames_per_second{device="$device"}', "{{stream}}"),),
    ),
    Panel(
        "Latency percentiles",
        "timeseries",
        (('edge_stream_latency_seconds{device="$device",stage="total"}', "{{stream}} p{{quantile}}"),),
        unit="s",
    ),
    Panel(
        "Dropped frames by reason",
        "timeseries",
        (
            (
                'rate(edge_stream_dropped_frames_total{device="$device"}[$__rate_interval])',
                "{{stream}} {{reason}}",
            ),
        ),
    ),
    Panel(
        "CPU",
        "timeseries",
        (
            ('edge_process_cpu_percent{device="$device"}', "agent"),
            ('edge_cpu_percent{device="$device"}', "system"),
        ),
        unit="percent",
    ),
    Panel(
        "Agent memory (RSS)",
        "timeseries",
        (('edge_process_resident_memory_bytes{device="$device"}', "rss"),),
        unit="bytes",
    ),
    Panel(
        "Temperatures",
        "timeseries",
        (('edge_temperature_celsius{device="$device"}', "{{zone}}"),),
        unit="celsius",
    ),
    Panel(
        "GPU load and clocks",
        "timeseries",
        (
            ('edge_load_percent{device="$device"}', "{{unit}} load %"),
            ('edge_clock_hertz{device="$device"} / 1e6', "{{clock}} MHz"),
        ),
    ),
    Panel("Spool depth", "timeseries", (('edge_mqtt_spool_depth_messages{device="$device"}', "messages"),)),
    Panel("Online", "stat", (('edge_device_online{device="$device"}', "online"),), width=4),
    Panel("Session", "stat", (('edge_device_session{device="$device"}', "session"),), width=4),
)


def _panel(spec: Panel) -> Any:
    builder: Any
    if spec.kind == "stat":
        builder = stat.Panel()
    elif spec.kind == "table":
        builder = table.Panel()
    else:
        builder = timeseries.Panel()
    builder = builder.title(spec.title).datasource(DATASOURCE).unit(spec.unit).height(8).span(spec.width)
    for ref, (expr, legend) in zip("ABCDEFGH", spec.queries, strict=False):
        query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
        if spec.kind == "table":
            query = query.instant().format(PromQueryFormat.TABLE)
        builder = builder.with_target(query)
    return builder


def _variables(board: Any) -> Any:
    source = dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    site = (
        dashboard.QueryVariable("site")
        .label("Site")
        .datasource(DATASOURCE)
        .query("label_values(edge_device_info, site)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    device = (
        dashboard.QueryVariable("device")
        .label("Device")
        .datasource(DATASOURCE)
        .query('label_values(edge_device_info{site=~"$site"}, device)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    return board.with_variable(source).with_variable(site).with_variable(device)


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict)."""
    board = (
        dashboard.Dashboard("Edge fleet")
        .uid("edge-fleet")
        .tags(["edge-agent", "jetson"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
    )
    board = _variables(board)
    board = board.with_row(dashboard.Row("Fleet overview"))
    for spec in OVERVIEW:
        board = board.with_panel(_panel(spec))
    board = board.with_row(dashboard.Row("Device $device"))
    for spec in DEVICE:
        board = board.with_panel(_panel(spec))
    result: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return result


def render() -> str:
    """The file's text: sorted keys, two-space indent, a final newline (stable diffs)."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = OUTPUT.is_file() and OUTPUT.read_text(encoding="utf-8") == text
        if not same:
            print(f"{OUTPUT} is out of date: run python tools/make_dashboard.py", file=sys.stderr)
        return 0 if same else 1
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUTPUT.with_suffix(".json.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(OUTPUT)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
