"""The agent's persisted state: which model is active in each slot, and the last known good one.

It lives in ``<state_dir>/state.json`` and is rewritten atomically on every change. A missing file
is a fresh device; a corrupt one is moved aside (``state.json.corrupt-<timestamp>``) and the agent
starts from empty state instead of crashing, because a device that will not start cannot be fixed
remotely, while empty state only means the slots fall back to the models in the configuration.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.fsutil import atomic_write_json

log = structlog.get_logger(__name__)

#: File name of the state file inside the state directory.
STATE_FILE_NAME = "state.json"

#: Version of the state file layout, written into the file.
STATE_SCHEMA_VERSION = 1


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class _StateModel(BaseModel):
    # Unlike configuration, the state file ignores unknown keys: after an agent downgrade the
    # older agent must still read what a newer one wrote rather than discard the whole state.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ModelRecord(_StateModel):
    """One model that was activated in a slot."""

    model_id: str = Field(description="Model name reported with results.")
    version: str | None = Field(default=None, description="Model version reported with results.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the ONNX model file (lowercase hex)."
    )
    path: str = Field(description="Model file the slot loaded.")
    backend: str = Field(description="Backend key that ran it, e.g. onnxruntime or tensorrt.")
    activated_at: datetime = Field(default_factory=_utcnow, description="When it became active (UTC).")
    engine_key: str | None = Field(
        default=None, description="Engine cache key of the built engine it ran (None: the ONNX model itself)."
    )
    build: dict[str, Any] | None = Field(
        default=None, description="The build request (BuildSpec) that engine was made with, to find it again."
    )
    preprocess: dict[str, Any] | None = Field(
        default=None, description="Preprocessing it ran with (a deployment may bring its own)."
    )
    postprocess: dict[str, Any] | None = Field(
        default=None, description="Postprocessing it ran with, labels included."
    )
    origin: Literal["config", "delivery", "rollback"] = Field(
        default="config", description="How it got there: the config file, a deployment, a rollback."
    )
    share_engines: bool = Field(
        default=False,
        description="Its deployment shared engines through the fleet: a rebuild asks the controller first.",
    )


class SlotState(_StateModel):
    """What one slot runs now and what it falls back to."""

    active: ModelRecord | None = Field(default=None, description="Model serving the slot now.")
    last_known_good: ModelRecord | None = Field(
        default=None,
        description="The model active before ``active``: the rollback target. None after a rollback "
        "(a rollback goes back one step, never forward) until another model is activated.",
    )
    config_sha256: str | None = Field(
        default=None,
        description="SHA-256 of the slot's model file in the config when the agent last started: a "
        "delivered model outlives restarts until the operator changes the config's model.",
    )


class AgentState(_StateModel):
    """The whole state file."""

    schema_version: int = Field(default=STATE_SCHEMA_VERSION, description="Layout version of the file.")
    slots: dict[str, SlotState] = Field(default_factory=dict, description="State per slot name.")

    def slot(self, name: str) -> SlotState:
        """Return the state of slot ``name`` (empty if the slot has never activated a model)."""
        return self.slots.get(name, SlotState())


def record_activation(state: AgentState, slot: str, record: ModelRecord) -> AgentState:
    """Return a new state in which ``record`` is active in ``slot``.

    The previously active model becomes the last known good one, unless it is the same model being
    activated again (a restart restoring it, a reload of an unchanged config): then the last known
    good one is kept. The same bytes under another version, id or processing are another model: it
    ran, so a rollback must be able to bring it back.
    """
    current = state.slot(slot)
    previous = current.active
    last_known_good = current.last_known_good
    if previous is not None and not same_model(previous, record):
        last_known_good = previous
    slots = dict(state.slots)
    slots[slot] = current.model_copy(update={"active": record, "last_known_good": last_known_good})
    return state.model_copy(update={"slots": slots})


#: What makes two records the same model: what it is called, its bytes, and how it runs. Not when it
#: was activated, how it got there, or where its file lies (the same bytes under the config's path).
_SAME_MODEL_FIELDS = (
    "model_id",
    "version",
    "sha256",
    "backend",
    "engine_key",
    "build",
    "preprocess",
    "postprocess",
)


def same_model(a: ModelRecord, b: ModelRecord) -> bool:
    """True when ``a`` and ``b`` are one model activated twice, not two models (pure)."""
    return all(getattr(a, name) == getattr(b, name) for name in _SAME_MODEL_FIELDS)


def record_rollback(state: AgentState, slot: str, record: ModelRecord) -> AgentState:
    """Return a new state in which ``record`` (the slot's last-known-good model) is active again.

    A rollback goes back one step and never forward: the model it leaves is not kept as the next
    rollback target (it is the one being rolled back from), so the slot has no last-known-good
    until another model is activated (a deployment, a config change). A second rollback is refused
    instead of swapping back to the newer model.
    """
    current = state.slot(slot)
    if current.active is not None and same_model(current.active, record):
        # A way back to the model the slot serves already (it never ran the newer one) leaves nothing.
        return record_activation(state, slot, record)
    slots = dict(state.slots)
    slots[slot] = current.model_copy(update={"active": record, "last_known_good": None})
    return state.model_copy(update={"slots": slots})


def record_config_model(state: AgentState, slot: str, sha256: str | None) -> AgentState:
    """Return a new state remembering which model file the config names for ``slot``."""
    slots = dict(state.slots)
    slots[slot] = state.slot(slot).model_copy(update={"config_sha256": sha256})
    return state.model_copy(update={"slots": slots})


class StateFile:
    """Loads and saves :class:`AgentState` at ``path``; safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    @classmethod
    def in_dir(cls, state_dir: Path) -> StateFile:
        """The state file of the agent whose state directory is ``state_dir``."""
        return cls(Path(state_dir) / STATE_FILE_NAME)

    def load(self) -> AgentState:
        """Read the state; a missing file gives empty state, a corrupt one is set aside. Never raises."""
        with self._lock:
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                return AgentState()
            except OSError as exc:
                return self._set_aside(f"unreadable: {exc}")
            try:
                return AgentState.model_validate(json.loads(raw.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError, ValidationError) as exc:
                return self._set_aside(str(exc))

    def save(self, state: AgentState) -> None:
        """Write ``state`` atomically, creating the state directory if needed."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, state.model_dump(mode="json"))

    def _set_aside(self, reason: str) -> AgentState:
        stamp = _utcnow().strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
            n += 1
        try:
            self.path.rename(target)
        except OSError as exc:
            # Keep going with empty state: the next save() overwrites the bad file anyway.
            log.error("state.corrupt", path=str(self.path), reason=reason, moved_to=None, move_error=str(exc))
        else:
            log.error("state.corrupt", path=str(self.path), reason=reason, moved_to=str(target))
        return AgentState()
