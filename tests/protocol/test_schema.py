"""JSON Schema export: one file per message, each accepting that message's example."""

from __future__ import annotations

import json
from pathlib import Path

from agent.protocol.messages import MESSAGE_MODELS, encode
from agent.protocol.schema import write_schemas
from tests.protocol.examples import EXAMPLES


def test_one_schema_per_message(tmp_path: Path) -> None:
    paths = write_schemas(tmp_path / "schemas")
    assert sorted(p.name for p in paths) == sorted(f"{m.__name__}.schema.json" for m in MESSAGE_MODELS)
    for path in paths:
        schema = json.loads(path.read_text())
        name = path.name.removesuffix(".schema.json")
        assert schema["title"] == name
        example = json.loads(encode(EXAMPLES[name]))
        # Every required property is present in the example (a light check without a validator library).
        assert set(schema.get("required", [])) <= set(example)
        if name == "TelemetryMessage":
            assert schema["additionalProperties"] == {"type": "number"}
        else:
            assert schema["additionalProperties"] is False
