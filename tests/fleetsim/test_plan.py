"""The simulator's flags: who is offline, unhealthy, labelled how (pure functions)."""

from __future__ import annotations

import random
import shlex
from pathlib import Path

import pytest

from agent.errors import UsageError
from agent.fleetsim.launcher import build_parser, fleet_setup
from agent.fleetsim.plan import OfflineWindow, choose, device_ids, parse_label, plan_fleet


def test_device_ids_sort_in_index_order() -> None:
    ids = device_ids(1000)
    assert ids[0] == "sim-0000"
    assert ids[999] == "sim-0999"
    assert sorted(ids) == ids
    assert device_ids(12000, "x")[11999] == "x-11999"


def test_a_share_rounds_up_and_a_range_limits_the_draw() -> None:
    rng = random.Random(0)
    # 3 % of a 50-device canary is 2 devices (1.5 rounded up), all among the first 50.
    chosen = choose("--unhealthy", "3%@0-49", 1000, rng)
    assert len(chosen) == 2
    assert all(0 <= i <= 49 for i in chosen)
    assert len(choose("--offline", "5%", 1000, rng)) == 50
    assert choose("--offline", "1@7-7", 10, rng) == [7]


@pytest.mark.parametrize(
    ("who", "fragment"),
    [
        ("five", "not a share"),
        ("101%", "above 100%"),
        ("11", "only 10 devices"),
        ("1.5", "whole number"),
        ("1@5-3", "index range"),
        ("1@0-10", "index range"),
    ],
)
def test_a_bad_who_names_the_flag_and_the_value(who: str, fragment: str) -> None:
    with pytest.raises(UsageError, match="--offline") as caught:
        choose("--offline", who, 10, random.Random(0))
    assert fragment in str(caught.value)


def test_the_same_seed_draws_the_same_devices() -> None:
    first = plan_fleet(100, offline=["5%:10-60"], unhealthy=["3:agreement"], seed=7)
    again = plan_fleet(100, offline=["5%:10-60"], unhealthy=["3:agreement"], seed=7)
    assert first == again
    assert sum(bool(p.offline) for p in first) == 5
    assert sum(p.unhealthy == "agreement" for p in first) == 3
    assert next(p for p in first if p.offline).offline == (OfflineWindow(10.0, 60.0),)


def test_labels_go_round_robin() -> None:
    plans = plan_fleet(3, labels=["site=berlin,munich", "hw=orin-nx"])
    assert [p.labels for p in plans] == [
        {"site": "berlin", "hw": "orin-nx"},
        {"site": "munich", "hw": "orin-nx"},
        {"site": "berlin", "hw": "orin-nx"},
    ]
    assert parse_label("camera=dock") == ("camera", ["dock"])


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ({"offline": ["5%"]}, "--offline: '5%' is not WHO:START-END"),
        ({"offline": ["5%:60-10"]}, "must end after it starts"),
        ({"unhealthy": ["5%:speed"]}, "FIGURE is one of agreement"),
        ({"labels": ["site"]}, "--label: 'site' is not KEY=VALUE"),
        ({"labels": ["site=a,,b"]}, "--label"),
    ],
)
def test_bad_flags_are_refused_with_the_flag_named(flags: dict[str, list[str]], fragment: str) -> None:
    with pytest.raises(UsageError) as caught:
        plan_fleet(10, **flags)  # type: ignore[arg-type]
    assert fragment in str(caught.value)


def test_the_documented_command_parses_and_plans() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "fleet.md").read_text()
    section = doc.split("## Fleet simulator", 1)[1]
    command = section.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "agent.fleetsim"]
    args = build_parser().parse_args(words[3:])
    plans = plan_fleet(args.devices, labels=args.label, offline=args.offline, unhealthy=args.unhealthy)
    assert len(plans) == 1000
    assert sum(bool(p.offline) for p in plans) == 50
    assert [p.index for p in plans if p.unhealthy == "nan_outputs"] == sorted(
        p.index for p in plans if p.unhealthy and p.index < 50
    )
    assert sum(p.unhealthy is not None for p in plans) == 2
    assert plans[1].labels == {"site": "munich", "hw": "orin-nano"}


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_report_interval_not_above_zero_names_the_flag(value: str, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--trust", str(tmp_path / "key.pem"), "--state-dir", str(tmp_path), "--report-s", value]
    )
    with pytest.raises(UsageError, match="--report-s"):
        fleet_setup(args)


def test_a_chunk_timeout_not_above_zero_names_the_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--trust", str(tmp_path / "key.pem"), "--state-dir", str(tmp_path), "--chunk-timeout-s", "0"]
    )
    with pytest.raises(UsageError, match="--chunk-timeout-s"):
        fleet_setup(args)
