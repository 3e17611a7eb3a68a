"""JSON Schema export: one file per message, each accepting that message's example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.protocol.messages import MESSAGE_MODELS, encode
from agent.schemas import write_schemas
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


def _documented_models() -> set[str]:
    """Every message model docs/protocol.md gives a ``### CamelCaseName`` section and docs/delivery.md names
    as a ``payload `Name```."""
    import re

    docs = Path(__file__).resolve().parents[2] / "docs"
    protocol = re.findall(r"^### ([A-Z][a-z]+[A-Z][A-Za-z]*)$", (docs / "protocol.md").read_text(), re.M)
    delivery = re.findall(r"payload `([A-Z][A-Za-z]+)`", (docs / "delivery.md").read_text())
    return set(protocol) | set(delivery)


def test_edge_agent_schema_writes_every_model_the_docs_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22.12: RolloutRequest, RolloutStatus and ChunkRequest were documented but not written."""
    from agent.cli import main

    documented = _documented_models()
    assert {"RolloutRequest", "RolloutStatus", "ChunkRequest", "JobStatus", "DeployManifest"} <= documented

    assert main(["schema", "--out", str(tmp_path)]) == 0

    written = {p.name.removesuffix(".schema.json") for p in tmp_path.iterdir()}
    assert documented <= written, f"documented but not written: {sorted(documented - written)}"
    assert len(capsys.readouterr().out.splitlines()) == len(written)
    for name in written:
        schema = json.loads((tmp_path / f"{name}.schema.json").read_text())
        assert schema["title"] == name
