"""docs/console.md ("What the controller keeps of a device") and docs/fleet.md ("The controller")
state the fleet view's bounds and settings: each figure is the code's own."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from agent.config import read_yaml
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.view.cameras import MAX_CAMERAS
from agent.fleet.view.chart_history import CHARTED, POINT_BYTES
from agent.fleet.view.device_record import (
    FIGURE_NAME_CHARS,
    INFO_BYTES,
    JOB_BYTES,
    MAX_FIGURE_NAME,
    MAX_FIGURES,
    MAX_HISTORY_POINTS,
    MAX_JOBS,
    MSG_ID_CHARS,
    SEEN_JOB_IDS,
)
from agent.fleet.view.live import MAX_DEVICE_ID, FleetView
from agent.fleet.view.status import JSON_TEXT_LIMIT, MAX_PROBLEMS

DOCS = Path(__file__).resolve().parents[3] / "docs"
CONSOLE = (DOCS / "console.md").read_text(encoding="utf-8")
FLEET = (DOCS / "fleet.md").read_text(encoding="utf-8")
EXAMPLE = Path(__file__).resolve().parents[3] / "configs" / "controller.yaml"


def _bounds() -> dict[str, str]:
    section = CONSOLE.split("## What the controller keeps of a device", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    return dict(row for row in rows if row != ("what", "bound"))


def _n(value: int) -> str:
    return f"{value:,}"


def test_the_bounds_table_gives_the_codes_figures() -> None:
    bounds = _bounds()
    assert bounds["every string (ids, versions, labels, errors, keys)"] == f"{_n(JSON_TEXT_LIMIT)} characters"
    assert bounds["device id"].startswith(f"{MAX_DEVICE_ID} characters; a longer one is refused")
    assert bounds["`up/info` as kept (slots, then labels, then platform)"].startswith(
        f"{INFO_BYTES // 1024} KiB"
    )
    assert bounds["cameras (from `up/info`, inside its 64 KiB, after the slots)"] == (
        f"{MAX_CAMERAS}, the first by name"
    )
    assert bounds["latest `up/telemetry`"] == (
        f"{_n(MAX_FIGURES)} figures, names of at most {MAX_FIGURE_NAME} characters, "
        f"{FIGURE_NAME_CHARS // 1024} KiB of names in all"
    )
    assert bounds["chart history"] == (
        f"{_n(MAX_HISTORY_POINTS)} points (an hour at one a second) of {len(CHARTED)} figures: "
        f"{POINT_BYTES} bytes a point, {MAX_HISTORY_POINTS * POINT_BYTES // 1000} KB"
    )
    jobs = f"the last {MAX_JOBS}, each within {JOB_BYTES // 1024} KiB"
    assert bounds["jobs"] == f"{jobs} (ids, error text, shadow and probation figures)"
    assert bounds["malformed-message lines"] == f"{MAX_PROBLEMS} (a repeated one once)"
    assert bounds["job message ids remembered (to drop repeats)"] == (
        f"{SEEN_JOB_IDS}, each cut to {MSG_ID_CHARS} characters"
    )


def test_the_view_settings_example_is_the_default_and_the_example_configs() -> None:
    block = re.search(r"```yaml\n(max_devices: .*?)```", FLEET, re.DOTALL)
    assert block, "docs/fleet.md has no max_devices example"
    settings = yaml.safe_load(block.group(1))
    config = ControllerConfig.model_validate({"unsigned": True, **settings})
    defaults = ControllerConfig(unsigned=True)
    assert (config.max_devices, config.forget_after_s) == (defaults.max_devices, defaults.forget_after_s)
    example = ControllerConfig.model_validate(read_yaml(EXAMPLE))
    assert (example.max_devices, example.forget_after_s) == (config.max_devices, config.forget_after_s)
    view = FleetView("fleet/v1")  # the view's own defaults are the controller's
    assert (view.max_devices, view.forget_after_s) == (config.max_devices, config.forget_after_s)
