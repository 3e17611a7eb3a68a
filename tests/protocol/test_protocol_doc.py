"""docs/protocol.md shows a valid example of every message and spells every topic of the tree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.protocol.messages import MESSAGE_MODELS, decode, encode
from agent.protocol.topics import Topics
from tests.protocol.examples import EXAMPLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _example_after_heading(text: str, name: str) -> str:
    match = re.search(rf"^### {name}\n(.*?)```json\n(.*?)```", text, re.S | re.M)
    assert match, f"docs/protocol.md has no '### {name}' section with a ```json example"
    return match.group(2)


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda m: m.__name__)
def test_doc_example_is_valid_and_current(model: type[BaseModel]) -> None:
    text = DOC.read_text()
    example = _example_after_heading(text, model.__name__)
    parsed = decode(model, example.encode())
    # Current: the doc shows what the model encodes today (regenerate from tests/protocol/examples.py).
    assert json.loads(example) == json.loads(encode(EXAMPLES[model.__name__]))
    assert parsed == EXAMPLES[model.__name__]


def test_every_message_has_an_example() -> None:
    assert set(EXAMPLES) == {m.__name__ for m in MESSAGE_MODELS}


def test_doc_spells_every_topic_of_the_tree() -> None:
    text = DOC.read_text()
    t = Topics("{p}", "{dev}")
    topics = [
        t.status, t.info, t.telemetry, t.xfer_req, t.results("{stream}"), t.jobs("{job_id}"),
        t.cmd_reply("{name}"), t.desired("{slot}"), t.xfer("{sha256}"), t.cmd("{name}"),
    ]  # fmt: skip
    for topic in topics:
        assert f"`{topic}`" in text, topic
    assert "pattern write fleet/v1/%u/up/#" in text
