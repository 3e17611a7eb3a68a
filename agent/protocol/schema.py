"""JSON Schema export of every message, for consumers in other languages (dashboards, fleet tools)."""

from __future__ import annotations

import json
from pathlib import Path

from agent.protocol.messages import MESSAGE_MODELS


def write_schemas(out_dir: Path) -> list[Path]:
    """Write ``<MessageName>.schema.json`` for every message model into ``out_dir``; return the paths.

    The schemas describe the payload as it arrives (validation mode: fields with defaults are optional).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model in MESSAGE_MODELS:
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        path = out_dir / f"{model.__name__}.schema.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        written.append(path)
    return written
