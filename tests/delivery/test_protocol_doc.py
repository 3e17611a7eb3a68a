"""docs/protocol.md shows current, valid examples of the delivery payloads and documents every code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent.errors import DeliveryError
from agent.protocol import delivery_errors
from agent.protocol.manifest import DeployManifest, SignedManifest
from tests.protocol.examples import DELIVERY_EXAMPLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.mark.parametrize("model", [DeployManifest, SignedManifest], ids=lambda m: m.__name__)
def test_doc_example_is_valid_and_current(model: type[DeployManifest] | type[SignedManifest]) -> None:
    match = re.search(rf"^### {model.__name__}\n(.*?)```json\n(.*?)```", DOC.read_text(), re.S | re.M)
    assert match, f"docs/protocol.md has no '### {model.__name__}' section with a ```json example"
    example = match.group(2)
    assert model.model_validate_json(example) == DELIVERY_EXAMPLES[model.__name__]
    expected = DELIVERY_EXAMPLES[model.__name__].model_dump_json(exclude_none=True)
    assert json.loads(example) == json.loads(expected)


def test_doc_lists_every_delivery_error_code() -> None:
    text = DOC.read_text()
    codes = {
        cls.code
        for cls in vars(delivery_errors).values()
        if isinstance(cls, type)
        and issubclass(cls, DeliveryError)
        and getattr(cls, "rejects", None) is not None
    }
    codes -= {"rejected", "cancelled"}  # abstract base and internal control flow
    missing = [code for code in sorted(codes) if f"| `{code}` |" not in text]
    assert missing == []
