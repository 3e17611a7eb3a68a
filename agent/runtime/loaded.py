"""A model loaded for a slot: runner, pre/postprocessing, identity, and its in-flight lease count."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import structlog

from agent.backends.base import ProviderRequest, Runner
from agent.camera.preprocess_spec import PreprocessSpec
from agent.engines.spec import BuildSpec
from agent.postprocess.runner import Postprocessor
from agent.protocol.messages import ModelRef
from agent.runtime.health import ModelHealth
from agent.transitions import TransitionTable

log = structlog.get_logger(__name__)


class ModelState(str, Enum):
    """Lifecycle of one loaded model. A slot swaps whole ``LoadedModel`` objects."""

    LOADING = "loading"
    VALIDATING = "validating"
    ACTIVE = "active"
    DRAINING = "draining"
    RELEASED = "released"
    FAILED = "failed"


#: Allowed lifecycle transitions, in one table.
MODEL_TRANSITIONS = TransitionTable(
    ModelState,
    {
        ModelState.LOADING: frozenset({ModelState.VALIDATING, ModelState.FAILED}),
        ModelState.VALIDATING: frozenset({ModelState.ACTIVE, ModelState.FAILED}),
        ModelState.ACTIVE: frozenset({ModelState.DRAINING}),
        ModelState.DRAINING: frozenset({ModelState.RELEASED}),
        ModelState.RELEASED: frozenset(),
        ModelState.FAILED: frozenset(),
    },
)


@dataclass(frozen=True)
class ModelSource:
    """Everything needed to load a model into a slot (from the config or from a delivery)."""

    path: Path
    model_id: str
    version: str | None
    backend: str
    providers: tuple[ProviderRequest, ...]
    intra_op_threads: int
    preprocess: PreprocessSpec
    postprocess: object  # PostprocessSpec (a pydantic union; kept opaque here)
    base_dir: Path | None = None
    max_batch: int = 4
    #: ONNX Runtime worker threads busy-wait between runs (see agent.backends.onnxruntime).
    allow_spinning: bool = False
    #: Backend-specific load options from the engine build (DLA core, provider options).
    extra: tuple[tuple[str, object], ...] = ()
    #: Identity of the ONNX model this engine was built from (default: hash of ``path``).
    sha256: str | None = None
    #: The ONNX model file recorded in state.json (default: ``path``); an engine may be rebuilt from it.
    model_path: Path | None = None
    #: Engine cache key when ``path`` is a built engine (kept from eviction while active or last-known-good).
    engine_key: str | None = None
    #: The build request that made the engine (recorded so a restart finds it in the cache again).
    build: BuildSpec | None = None


@dataclass
class LoadedModel:
    """A runner plus what it takes to feed it and read it, and a lease count for draining.

    The inference stage leases the slot's current model for each batch; a swapped-out model is
    released (its runner closed) when its last lease ends, so in-flight batches finish on it.
    """

    source: ModelSource
    ref: ModelRef
    runner: Runner
    postprocessor: Postprocessor
    input_name: str
    loaded_at: float = field(default_factory=time.time)
    state: ModelState = ModelState.LOADING
    #: What the frame path saw of this model (probation compares it with the previous model's).
    health: ModelHealth = field(default_factory=ModelHealth)
    _leases: int = 0
    #: Results inferred on this model and not yet published (or dropped) by the publish stage.
    _unpublished: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def preprocess(self) -> PreprocessSpec:
        return self.source.preprocess

    def transition(self, new: ModelState) -> None:
        with self._lock:
            self._transition_locked(new)

    def _transition_locked(self, new: ModelState) -> None:
        MODEL_TRANSITIONS.check(self.state, new, who=f"model {self.ref.model_id}")
        log.info(
            "model.state", slot=self.ref.slot, model=self.ref.model_id, old=self.state.value, new=new.value
        )
        self.state = new

    def acquire(self) -> None:
        with self._lock:
            self._leases += 1

    def release(self) -> None:
        with self._lock:
            self._leases -= 1
            done = self._leases == 0 and self.state is ModelState.DRAINING
            if done:
                self._transition_locked(ModelState.RELEASED)
        if done:
            self.runner.close()

    def retire(self) -> None:
        """Stop taking new leases; close once in-flight batches have finished."""
        with self._lock:
            if self.state is not ModelState.ACTIVE:
                return
            self._transition_locked(ModelState.DRAINING)
            done = self._leases == 0
            if done:
                self._transition_locked(ModelState.RELEASED)
        if done:
            self.runner.close()

    @property
    def leases(self) -> int:
        return self._leases

    def results_pending(self, n: int) -> None:
        """``n`` results of this model entered (positive) or left (negative) the publish stage."""
        with self._lock:
            self._unpublished += n

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no batch runs on this model and none of its results waits to be published.

        After a swap-back, this is what makes "no result comes from the rejected model after the
        decision" true: the decision is announced only once its last result is out.
        """
        deadline = time.monotonic() + timeout
        while self._leases > 0 or self._unpublished > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
