"""Comments and docstrings say why, not when: no issue numbers, no commit ids (docs/benchmarks.md
holds the measured figures and their dates).

Every comment and docstring of ``agent/``, ``bench/`` and ``tools/`` is read with ``tokenize`` and
``ast``; each rule is also shown to fail on a sample that breaks it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREES = ("agent", "bench", "tools")

#: What a comment may not say, with the reason the test gives.
RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE), "an issue number"),
    # A bare ``#12`` is this project's issue; ``paho#226`` names another project's tracker (a why).
    (re.compile(r"(?<![\w.\-/])#\d{2,}\b"), "an issue reference"),
    (re.compile(r"\bcommits?\s+[0-9a-f]{7,40}\b"), "a commit id"),
    (
        re.compile(r"\b(?:before|after|since|at)\s+\(?(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
        "a commit id",
    ),
)


def texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def findings(source: str) -> list[str]:
    """``line: reason: text`` for each rule a comment or docstring of ``source`` breaks."""
    found = []
    for line, text in texts(source):
        for pattern, reason in RULES:
            if match := pattern.search(text):
                found.append(f"{line}: {reason}: {match.group(0)!r}")
    return found


def test_no_comment_or_docstring_names_an_issue_or_a_commit() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{finding}"
        for tree in TREES
        for path in sorted((REPO / tree).rglob("*.py"))
        for finding in findings(path.read_text(encoding="utf-8"))
    ]
    why = "comments say why, not when (history belongs in git, figures in docs/benchmarks.md)"
    assert not bad, why + ":\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "x = 1  # the spool grew without this (issue 8)\n",
        '"""Module.\n\nSee issue 22.11 for what the build said."""\n',
        "def f() -> None:\n    # fixed in #42\n    pass\n",
        'class C:\n    """Twice as fast since commit 51380c1."""\n',
        "y = 2  # 0.9 ms before 19503b7\n",
    ],
)
def test_each_rule_finds_what_it_forbids(source: str) -> None:
    assert findings(source)


def test_an_upstream_tracker_a_hash_and_a_plain_number_pass() -> None:
    source = (
        "# paho#226: our lock in on_publish could deadlock against paho's; TensorRT#1378\n"
        "SHA = 'deadbeefcafe'  # a 12-character key, written 'at 4 workers'\n"
        '"""Retried 12 times, at most 16 issues of a queue."""\n'
    )
    assert findings(source) == []
