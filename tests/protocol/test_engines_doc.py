"""docs/protocol.md's "Engines shared through the fleet": valid examples of every engine message, and
the topics spelled as the tree spells them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.fleet.engines.settings import EngineShareSettings
from agent.protocol.engines import EngineAsk, EngineClaim, EngineDrop, EngineOffer, SignedEngine
from agent.protocol.topics import Topics, parse
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.mark.parametrize(
    "model", [EngineAsk, EngineClaim, EngineOffer, SignedEngine, EngineDrop], ids=lambda m: m.__name__
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
    for verb in ("ask", "offer", "piece", "drop", "claim"):
        assert f"| `{verb}` |" in text
        parsed = parse(Topics("fleet/v1", "jet-01").engines_request(verb), "fleet/v1")
        assert (parsed.device, parsed.direction, parsed.kind, parsed.arg) == ("jet-01", "up", "engines", verb)
    with pytest.raises(ValueError, match="up/engines has the levels"):
        parse("fleet/v1/jet-01/up/engines/steal", "fleet/v1")
    with pytest.raises(ValueError, match="down/engines only has the level"):
        parse("fleet/v1/jet-01/down/engines/ask", "fleet/v1")


def test_the_ask_replies_the_doc_shows_have_the_shape_the_desk_answers(tmp_path: Path) -> None:
    """The two claim replies of "Build claims" next to what a real desk answers two askers."""
    text = DOC.read_text().split("Replies to `ask`, for example", 1)[1].split("**Start-up builds.**", 1)[0]
    build, wait = (json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S))
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate(), settings=EngineShareSettings())
    ask = EngineAsk(key="5c" * 32).model_dump_json().encode()
    first = desk.handle("jet-01", "ask", ask, {})
    second = desk.handle("jet-02", "ask", ask, {})
    for documented, real in ((build, first), (wait, second)):
        assert documented.keys() == real.keys()
        for field in ("claim", "building"):
            if field in real:
                assert documented[field].keys() == real[field].keys()
        assert (documented["found"], documented["build"]) == (real["found"], real["build"])
    assert second["building"]["device"] == "jet-01"
    assert second["reason"].startswith(f"engine {'5c' * 6} is being built by jet-01 since ")
    assert desk.handle(
        "jet-01", "claim", EngineClaim(key="5c" * 32, action="release").model_dump_json().encode(), {}
    ) == {"released": True}
    assert desk.handle("jet-02", "ask", ask, {})["build"] is True  # the claim went to the next asker
