"""JSON Schema export of every message, for consumers in other languages (dashboards, fleet tools)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from agent.fsutil import atomic_write_bytes
from agent.protocol.messages import MESSAGE_MODELS


def write_schemas(out_dir: Path, models: Iterable[type[BaseModel]] = MESSAGE_MODELS) -> list[Path]:
    """Write ``<MessageName>.schema.json`` for every model of ``models`` into ``out_dir``; return the paths.

    ``models`` defaults to every message model of this package; ``edge-agent schema`` adds the deploy
    manifest's (``SignedManifest``, ``DeployManifest``), which live in ``agent.delivery``.
    The schemas describe the payload as it arrives (validation mode: fields with defaults are optional).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model in models:
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        path = out_dir / f"{model.__name__}.schema.json"
        atomic_write_bytes(path, (json.dumps(schema, indent=2, sort_keys=True) + "\n").encode())
        written.append(path)
    return written
