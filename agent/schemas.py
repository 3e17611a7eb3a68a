"""Every MQTT message model, wherever its package lives, and their JSON Schemas (``edge-agent schema``).

The device's messages are :data:`agent.protocol.messages.MESSAGE_MODELS` and the opt-in sample
(:mod:`agent.protocol.samples`); the deploy manifest and the
chunk request live in :mod:`agent.delivery`, the controller's request and status in
:mod:`agent.fleet` (protocol must import neither), so the list is put together here, above all three.
``tests/protocol/test_schema.py`` checks it holds every model docs/protocol.md and docs/delivery.md
document.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.status_model import RolloutStatus
from agent.fsutil import atomic_write_bytes
from agent.protocol.chunks import ChunkRequest
from agent.protocol.engines import EngineAsk, EngineClaim, EngineDrop, EngineOffer, EngineRecord, SignedEngine
from agent.protocol.manifest import DeployManifest, SignedManifest
from agent.protocol.messages import MESSAGE_MODELS, RootChain
from agent.protocol.samples import SampleMessage

EVERY_MESSAGE: tuple[type[BaseModel], ...] = (
    *MESSAGE_MODELS,
    SampleMessage,
    SignedManifest,
    DeployManifest,
    ChunkRequest,
    RolloutRequest,
    RolloutStatus,
    EngineAsk,
    EngineOffer,
    EngineRecord,
    SignedEngine,
    EngineDrop,
    EngineClaim,
    RootChain,
)


def write_schemas(out_dir: Path, models: Iterable[type[BaseModel]] = MESSAGE_MODELS) -> list[Path]:
    """Write ``<MessageName>.schema.json`` for every model of ``models`` into ``out_dir``; return the paths.

    ``models`` defaults to the device's message models; ``edge-agent schema`` writes :data:`EVERY_MESSAGE`.
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
