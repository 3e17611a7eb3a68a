"""fit: a device's parsed message cut to a byte budget, entries kept in order, strings capped."""

from __future__ import annotations

import sys

from agent.fleet.base.bounded import cost, fit


def test_what_fits_comes_back_unchanged_and_uncut() -> None:
    value = {"slots": {"main": {"model_id": "net", "version": "4", "workers": 2}}, "labels": {"site": "lab"}}
    assert fit(value, 4096, 1024) == (value, False)


def test_a_huge_nested_value_is_cut_to_the_budget_keeping_the_first_entries_whole() -> None:
    value = {
        "first": {"model_id": "net", "version": "4"},
        "many": {f"k{i}": ["x" * 5000, i, {"deep": "y" * 5000}] for i in range(10_000)},
        "last": "never reached",
    }
    kept, cut = fit(value, 16 * 1024, 1024)
    assert cut
    assert kept["first"] == {"model_id": "net", "version": "4"}
    assert "last" not in kept
    assert cost(kept) <= 16 * 1024
    assert all(len(item[0]) <= 1024 for item in kept["many"].values())


def test_strings_and_keys_are_capped_and_wide_characters_cost_more() -> None:
    kept, cut = fit({"k" * 5000: "v" * 5000}, 1 << 20, 64)
    ((key, text),) = kept.items()
    assert cut
    assert (len(key), len(text)) == (64, 64)
    assert key.endswith("...")
    # A string of 4-byte characters takes up to four times the room of an ASCII one.
    wide, _ = fit(["\U0001f600" * 1000], 2048, 1024)
    narrow, _ = fit(["a" * 1000], 2048, 1024)
    assert len(narrow[0]) == 1000
    assert len(wide[0]) < 2048 / 4
    assert cost(wide) <= 2048


def test_the_estimate_is_not_below_what_cpython_holds() -> None:
    value = {f"name{i}": [float(i), "text" * 10] for i in range(100)}
    held = sys.getsizeof(value) + sum(
        sys.getsizeof(k) + sys.getsizeof(v) + sum(sys.getsizeof(x) for x in v) for k, v in value.items()
    )
    assert cost(value) >= held
