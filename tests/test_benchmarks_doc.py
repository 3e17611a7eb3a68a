"""docs/benchmarks.md is the one page of measured figures: every table of it has a date column with a
date in each row; the other pages and the README carry no issue numbers, commit ids or session notes,
and the README opens with what the product does and its two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")
#: What a user's page does not say: the project's history is in git, its figures in benchmarks.md.
NOTEBOOK = re.compile(r"\b[Ii]ssues? \d+|\bcommit [0-9a-f]{7,40}\b|\bthis session\b|\bprevious session\b")


def tables(text: str) -> list[tuple[int, list[list[str]]]]:
    """(line number, rows as cells) of every Markdown table in ``text``, header first, separator left out."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and SEPARATOR.match(lines[i + 1].strip()):
            rows = [_cells(lines[i])]
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            found.append((i + 1, rows))
            i = j
        else:
            i += 1
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def undated(text: str) -> list[str]:
    """``line: why`` for each table without a date column, and each of its rows without a date."""
    problems = []
    for line, rows in tables(text):
        column = next((k for k, name in enumerate(rows[0]) if name.lower().startswith("date")), None)
        if column is None:
            problems.append(f"{line}: no date column in {rows[0]}")
            continue
        for n, row in enumerate(rows[1:], start=1):
            if column >= len(row) or not DATE.search(row[column]):
                problems.append(f"{line + n + 1}: no date in {row[:2]}")
    return problems


def test_every_figure_in_the_benchmarks_page_has_a_date() -> None:
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert tables(text), "docs/benchmarks.md has no tables"
    assert undated(text) == []


def test_every_section_of_the_benchmarks_page_says_when_where_and_how() -> None:
    sections = BENCHMARKS.read_text(encoding="utf-8").split("\n## ")[2:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        assert "\nRecorded: " in section, title
        assert "\nReproduce: " in section, title
        assert "`" in section.split("\nReproduce: ")[1].splitlines()[0], title


@pytest.mark.parametrize(
    "table",
    [
        "| benchmark | figure |\n|---|---|\n| heavy | 0.96x |\n",
        "| date | benchmark |\n|---|---|\n| yesterday | 0.96x |\n",
        "| date | benchmark |\n|---|---|\n| 2026-11-26 | 0.96x |\n| | 0.95x |\n",
    ],
)
def test_a_table_without_dates_is_found(table: str) -> None:
    assert undated("Some text.\n\n" + table)


def test_a_dated_table_passes() -> None:
    assert undated("| date, tree | wall |\n|---|---|\n| 2026-11-26 04:55, 19503b7 | 332 s |\n") == []


#: Every page a user reads; benchmarks.md names the code it measured, so it may name a commit.
PAGES = [REPO / "README.md", *sorted(p for p in DOCS.glob("*.md") if p != BENCHMARKS)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_reads_as_a_lab_notebook(page: Path) -> None:
    found = [m.group(0) for m in NOTEBOOK.finditer(page.read_text(encoding="utf-8"))]
    assert found == [], f"{page.name}: {found}"


def test_the_notebook_rule_finds_what_it_forbids() -> None:
    for text in ("as issue 22 asks", "measured before commit 51380c1", "not re-run this session"):
        assert NOTEBOOK.search(text), text


def test_the_readme_starts_with_what_it_does_and_the_two_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    before_block, block = text.split("```sh\n", 1)
    commands = [line.split("#")[0].strip() for line in block.split("```", 1)[0].splitlines()]
    assert commands == ["make demo", "make test"]
    paragraph = before_block.split("\n", 1)[1].strip()
    assert paragraph
    assert "\n\n" not in paragraph
    assert not DATE.search(paragraph)
