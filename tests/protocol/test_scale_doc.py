"""docs/scale.md's table of broker features names exactly the features the code relies on
(agent/mqtt/broker_features.py), and that list says where the code uses each: every module where a
feature's marker appears, no more and no fewer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.mqtt.broker_features import BROKER_FEATURES, BrokerFeature
from tests.test_benchmarks_doc import tables

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "scale.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
LISTING = "agent/mqtt/broker_features.py"


def _feature_table() -> list[list[str]]:
    found = [rows for _, rows in tables(DOC.read_text(encoding="utf-8")) if rows[0][0] == "feature"]
    assert len(found) == 1, "docs/scale.md has one table whose first column is 'feature'"
    return found[0][1:]


def modules_using(marker: str) -> set[str]:
    """Every module of agent/ whose text holds ``marker`` (the listing itself left out)."""
    return {
        str(path.relative_to(REPO))
        for path in sorted((REPO / "agent").rglob("*.py"))
        if marker in path.read_text(encoding="utf-8") and str(path.relative_to(REPO)) != LISTING
    }


def test_the_table_names_exactly_the_features_the_code_relies_on() -> None:
    assert [row[0] for row in _feature_table()] == [f.name for f in BROKER_FEATURES]


def test_every_row_says_its_use_its_caveat_with_a_source_and_how_the_design_copes() -> None:
    for row in _feature_table():
        assert len(row) == 4, row[0]
        assert all(row), row[0]
        assert re.search(r"\]\(https://", row[2]), f"{row[0]}: the caveat cites no source"


@pytest.mark.parametrize("feature", BROKER_FEATURES, ids=lambda f: f.name)
def test_the_listing_names_every_module_that_uses_a_feature(feature: BrokerFeature) -> None:
    assert modules_using(feature.marker) == set(feature.uses)


def test_a_new_use_of_a_feature_is_found() -> None:
    """The check above is not vacuous: the marker of a feature is found where the code uses it."""
    assert "agent/fleet/chunks/server.py" in modules_using("$share/")
    assert "agent/mqtt/core.py" in modules_using("clean_start=False")


def test_every_measured_figure_quoted_is_one_of_the_benchmarks_page() -> None:
    """A figure with a unit (cores, MB, messages a second) in docs/scale.md is in docs/benchmarks.md."""
    figures = re.findall(
        r"\b(\d[\d,.]*(?:-\d[\d,.]*)? (?:cores|MB|telemetry messages a second))", DOC.read_text()
    )
    assert figures
    benchmarks = BENCHMARKS.read_text(encoding="utf-8")
    missing = [f for f in figures if f.split()[0] not in benchmarks]
    assert missing == []
