"""Chunk notices on the wire (agent/protocol/chunks.py): what a server writes, what a device reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.protocol.chunks import (
    AHEAD_PROPERTY,
    MAX_NOTICE_MS,
    RETRY_PROPERTY,
    TIMEOUT_PROPERTY,
    WAIT_PROPERTY,
    ChunkNotice,
    notice_properties,
    read_notice,
)


@pytest.mark.parametrize(
    "notice", [ChunkNotice(wait_ms=4200, ahead=400), ChunkNotice(retry_ms=30_000), ChunkNotice(wait_ms=0)]
)
def test_a_notice_reads_back_as_written(notice: ChunkNotice) -> None:
    assert read_notice(dict(notice_properties(notice))) == notice


def test_the_properties_are_the_documented_names() -> None:
    assert notice_properties(ChunkNotice(wait_ms=4200, ahead=400)) == (("wait_ms", "4200"), ("ahead", "400"))
    assert notice_properties(ChunkNotice(retry_ms=5000)) == (("retry_ms", "5000"),)


@pytest.mark.parametrize(
    "properties",
    [
        {},  # a chunk reply without index: malformed, not a notice
        {"wait_ms": "soon"},
        {"retry_ms": "-5"},
        {"wait_ms": "1e9"},
        {"wait_ms": "1" * 40},
        {"ahead": "3"},  # a position alone says nothing about when
    ],
)
def test_garbled_notices_are_no_notices(properties: dict[str, str]) -> None:
    assert read_notice(properties) is None


def test_a_server_cannot_make_a_device_wait_longer_than_the_cap() -> None:
    notice = read_notice({"wait_ms": str(10**11), "retry_ms": str(10**11)})
    assert notice == ChunkNotice(wait_ms=MAX_NOTICE_MS, retry_ms=MAX_NOTICE_MS)


def test_delivery_md_documents_exactly_these_properties() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "delivery.md").read_text()
    section = doc.split("### Pacing", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    assert documented == {TIMEOUT_PROPERTY, WAIT_PROPERTY, AHEAD_PROPERTY, RETRY_PROPERTY}
    assert f"{MAX_NOTICE_MS:,}" in section
