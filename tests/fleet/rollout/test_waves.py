"""The rollout's shape from its flags: ``--waves``, ``--max-failed``, ``--soak``
(agent/fleet/rollout/waves.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import UsageError
from agent.fleet.rollout.waves import (
    FailureLimit,
    WaveEnd,
    parse_duration,
    parse_max_failed,
    parse_waves,
    split_waves,
)


def _devices(count: int) -> list[str]:
    return [f"jet-{index:04d}" for index in range(count)]


def test_waves_parse_counts_and_percentages_in_order() -> None:
    assert parse_waves("5, 10%,50%,100%") == (
        WaveEnd(count=5),
        WaveEnd(percent=10),
        WaveEnd(percent=50),
        WaveEnd(percent=100),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--waves: empty"),
        ("5,,100%", "item 2 is empty"),
        ("5,100%,", "item 3 is empty"),
        ("5,ten%,100%", "item 2 'ten%': not a device count"),
        ("0,100%", "item 1 '0': a wave needs at least 1 device"),
        ("5,150%", "item 2 '150%': a percentage must be above 0% and at most 100%"),
        ("0%,100%", "item 1 '0%': a percentage"),
        ("5,-3,100%", "item 2 '-3': not a device count"),
        ("50%,10%,100%", "item 2 '10%': waves are cumulative, so each must end above 50%"),
        ("10,5,100%", "item 2 '5': waves are cumulative, so each must end above 10"),
        ("5,10%,50%", "the last item 50% must be 100%"),
    ],
)
def test_a_bad_waves_item_is_named(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        parse_waves(text)


def test_waves_split_cumulatively_and_the_first_is_the_canary() -> None:
    waves = split_waves(_devices(1000), parse_waves("5,10%,50%,100%"))
    assert [len(wave) for wave in waves] == [5, 95, 400, 500]
    assert waves[0] == _devices(5)
    assert [device for wave in waves for device in wave] == _devices(1000)


def test_a_percentage_rounds_up_so_no_step_is_lost_to_rounding() -> None:
    assert [len(wave) for wave in split_waves(_devices(15), parse_waves("10%,100%"))] == [2, 13]


def test_a_wave_that_adds_no_device_on_this_selection_is_dropped() -> None:
    # 10 % of 20 is 2, already covered by the 5-device canary.
    assert [len(wave) for wave in split_waves(_devices(20), parse_waves("5,10%,100%"))] == [5, 15]
    # A canary larger than the selection takes it all.
    assert split_waves(_devices(3), parse_waves("5,100%")) == [_devices(3)]


def test_waves_of_counts_must_cover_the_whole_selection() -> None:
    assert [len(w) for w in split_waves(_devices(10), parse_waves("2,10"))] == [2, 8]
    with pytest.raises(
        UsageError, match="the last item 10 covers 10 of the 50 selected devices; end with 100%"
    ):
        split_waves(_devices(50), parse_waves("2,10"))


def test_a_device_selected_twice_is_refused() -> None:
    with pytest.raises(UsageError, match="device 'jet-1' is selected twice"):
        split_waves(["jet-1", "jet-2", "jet-1"], parse_waves("100%"))


def test_no_device_gives_no_wave() -> None:
    assert split_waves([], parse_waves("5,100%")) == []


@pytest.mark.parametrize(
    ("text", "touched", "allowed"),
    [
        ("3", 1000, 3),
        ("3", 5, 3),
        ("2%", 5, 0),
        ("2%", 50, 1),
        ("2%", 1000, 20),
        ("0", 10, 0),
        ("2.5%", 200, 5),
    ],
)
def test_max_failed_is_a_count_or_a_percentage_rounded_down(text: str, touched: int, allowed: int) -> None:
    assert parse_max_failed(text).allowed(touched) == allowed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("two", "--max-failed: 'two' is not a device count"),
        ("120%", "--max-failed: '120%' is above 100%"),
        ("-1", "'-1'"),
    ],
)
def test_a_bad_max_failed_is_named(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_max_failed(text)


def test_failure_limit_prints_as_given() -> None:
    assert str(FailureLimit(percent=2)) == "2%"
    assert str(FailureLimit(count=3)) == "3"


@pytest.mark.parametrize(
    ("text", "seconds"), [("10m", 600), ("30s", 30), ("1h", 3600), ("0", 0), ("1.5m", 90)]
)
def test_soak_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10 minutes", "-5s", "5d", "m"])
def test_a_bad_soak_is_named(text: str) -> None:
    with pytest.raises(UsageError, match=f"--soak: {text!r} is not a duration"):
        parse_duration(text)


def test_the_error_docs_fleet_md_shows_is_the_one_raised() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    with pytest.raises(UsageError) as caught:
        parse_waves("5,10x,100%")
    assert f"`{caught.value}`" in " ".join(doc.split())
    waves = split_waves(_devices(20), parse_waves("5,10%,100%"))
    assert "`5,10%,100%` on 20 devices gives waves of 5 and 15" in " ".join(doc.split())
    assert [len(wave) for wave in waves] == [5, 15]
