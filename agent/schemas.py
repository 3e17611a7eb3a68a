"""Every MQTT message model, wherever its package lives: what ``edge-agent schema`` writes.

The device's messages are :data:`agent.protocol.messages.MESSAGE_MODELS` and the opt-in sample
(:mod:`agent.protocol.samples`); the deploy manifest and the
chunk request live in :mod:`agent.delivery`, the controller's request and status in
:mod:`agent.fleet` (protocol must import neither), so the list is put together here, above all three.
``tests/protocol/test_schema.py`` checks it holds every model docs/protocol.md and docs/delivery.md
document.
"""

from __future__ import annotations

from pydantic import BaseModel

from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.status_model import RolloutStatus
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
