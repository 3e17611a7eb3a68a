"""docs/bundles.md says what the code does: its member table, its bounds, the tests its threat table names."""

from __future__ import annotations

import re
from pathlib import Path

from agent.trust import bundle

DOC = Path(__file__).resolve().parents[3] / "docs" / "bundles.md"
REPO = DOC.parents[1]


def test_every_test_the_doc_names_exists() -> None:
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", DOC.read_text()))
    assert len(named) >= 5
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE), f"{path}::{name}"


def test_the_member_table_is_the_format() -> None:
    table = DOC.read_text().split("## What the file is", 1)[1].split("\n## ", 1)[0]
    members = re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)
    assert members == [
        bundle.INDEX_MEMBER,
        bundle.ROOT_MEMBER,
        bundle.desired_member("<device>", "<target>"),
        bundle.blob_member("<sha256>"),
    ]


def test_the_bounds_the_doc_gives_are_the_readers() -> None:
    text = DOC.read_text()
    mib, gib = 1024 * 1024, 1024**3
    assert f"at most {bundle.MAX_INDEX_BYTES // mib} MiB" in text
    assert f"at most {bundle.MAX_MEMBERS} members" in text
    assert f"desired states {bundle.MAX_DESIRED_BYTES // mib} MiB" in text
    assert f"root chain {bundle.root_chain_bound() // mib} MiB" in text
    assert f"files {bundle.MAX_BLOB_BYTES // gib} GiB" in text
    assert f"at most {bundle.MAX_ENGINES_PER_DEVICE} per device" in text
