"""docs/protocol.md's "Engines shared through the fleet": valid examples of every engine message, and
the topics spelled as the tree spells them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.protocol.engines import EngineAsk, EngineDrop, EngineOffer, SignedEngine
from agent.protocol.topics import Topics, parse

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.mark.parametrize(
    "model", [EngineAsk, EngineOffer, SignedEngine, EngineDrop], ids=lambda m: m.__name__
)
def test_the_doc_shows_a_valid_example_of_each_engine_message(model: type[BaseModel]) -> None:
    match = re.search(rf"^### {model.__name__}\n(.*?)```json\n(.*?)```", DOC.read_text(), re.S | re.M)
    assert match, f"docs/protocol.md has no '### {model.__name__}' section with a ```json example"
    model.model_validate_json(match.group(2))


def test_the_doc_spells_the_engine_topics_and_the_tree_takes_them_apart() -> None:
    text = DOC.read_text()
    t = Topics("{p}", "{dev}")
    assert f"`{t.engines_reply}`" in text
    assert "`{p}/{dev}/up/engines/{verb}`" in text
    for verb in ("ask", "offer", "piece", "drop"):
        assert f"| `{verb}` |" in text
        parsed = parse(Topics("fleet/v1", "jet-01").engines_request(verb), "fleet/v1")
        assert (parsed.device, parsed.direction, parsed.kind, parsed.arg) == ("jet-01", "up", "engines", verb)
    with pytest.raises(ValueError, match="up/engines has the levels"):
        parse("fleet/v1/jet-01/up/engines/steal", "fleet/v1")
    with pytest.raises(ValueError, match="down/engines only has the level"):
        parse("fleet/v1/jet-01/down/engines/ask", "fleet/v1")
