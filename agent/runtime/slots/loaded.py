"""A model loaded for a slot: runner, pre/postprocessing, identity, and its in-flight lease count."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import structlog

from agent.backends.base import ProviderRequest, Runner
from agent.camera.gpu_preprocess import GpuPreprocessor, PreprocessChoice
from agent.postprocess.runner import Postprocessor
from agent.protocol.messages import ModelRef, RunsInfo
from agent.runtime.slots.health import ModelHealth
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec
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
    #: What this engine effectively is (device, precision, layers on DLA vs GPU), for status and up/info.
    report: EngineReport | None = None
    #: The slot's other engines when it runs on several devices at once (``build.devices``): each is
    #: loaded as one more :class:`LoadedModel` of the same set, and the set is swapped as one unit.
    engines: tuple[ModelSource, ...] = ()
    #: Its deployment let it take the engine from the fleet (``share_engines``): a rebuild of it
    #: (start-up after an upgrade or an eviction, a rollback) asks the controller first too.
    share_engines: bool = False
    #: What it runs as against what its build asked (precision, engine source, fallback), for
    #: up/info and the ``status`` command; None: the ONNX model as given.
    runs: RunsInfo | None = None


@dataclass(frozen=True)
class EngineReport:
    """One engine of a slot as built: where it runs and at what precision (published per engine)."""

    device: str
    precision: str | None = None
    dla_layers: int | None = None
    gpu_layers: int | None = None
    #: The build's requested device (``dla1``) when the plan moved it elsewhere (``gpu``, ``cpu``).
    requested: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The report as a JSON object, without unknown fields."""
        fields = {
            "device": self.device,
            "precision": self.precision,
            "dla_layers": self.dla_layers,
            "gpu_layers": self.gpu_layers,
            "requested": self.requested,
        }
        return {k: v for k, v in fields.items() if v is not None}


@dataclass
class LoadedModel:
    """A runner plus what it takes to feed it and read it, and a lease count for draining.

    The inference stage leases the slot's current model for each batch; a swapped-out model is
    released (its runner closed) when its last lease ends, so in-flight batches finish on it.

    A slot on several devices holds a *set*: this model (the first engine) and its ``peers`` (one
    per further device). The set shares one identity (``ref``) and one :class:`ModelHealth`, and
    lifecycle transitions and retirement apply to the whole set, so a swap replaces every engine at
    once; each inference worker leases one engine of the set (:meth:`engine_for`).
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
    #: The other engines of the set (empty: a slot on one device).
    peers: tuple[LoadedModel, ...] = ()
    #: Frames this engine inferred (its share of the slot's frames).
    frames: int = 0
    #: Set when frames for this engine are preprocessed on the GPU by the inference worker
    #: (agent.camera.gpu_preprocess); None: the capture threads preprocess them on the CPU.
    gpu_preprocessor: GpuPreprocessor | None = None
    #: Where this engine's frames are preprocessed and why, as up/info shows it.
    preprocess_choice: PreprocessChoice = field(
        default_factory=lambda: PreprocessChoice("cpu", "GPU preprocessing not considered")
    )
    _leases: int = 0
    #: Results inferred on this model and not yet published (or dropped) by the publish stage.
    _unpublished: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def preprocess(self) -> PreprocessSpec:
        return self.source.preprocess

    @property
    def preprocessed_on_gpu(self) -> bool:
        """Every engine of the set preprocesses on the GPU: capture threads leave frames as decoded."""
        return all(engine.gpu_preprocessor is not None for engine in self.engines)

    @property
    def engines(self) -> tuple[LoadedModel, ...]:
        """Every engine of the set, this one first."""
        return (self, *self.peers)

    def engine_for(self, worker: int) -> LoadedModel:
        """The engine inference worker ``worker`` runs on: workers are spread over the set in turn."""
        engines = self.engines
        return engines[worker % len(engines)]

    def counted(self, frames: int) -> None:
        """``frames`` more frames ran on this engine (its share, reported per engine)."""
        with self._lock:
            self.frames += frames

    def engine_shares(self) -> list[dict[str, object]]:
        """Per engine of the set: its report, frames inferred and share of the set's frames."""
        engines = self.engines
        total = sum(e.frames for e in engines)
        rows: list[dict[str, object]] = []
        for i, engine in enumerate(engines):
            report = engine.source.report or EngineReport(device=_device_of(engine.source))
            rows.append(
                {
                    "index": i,
                    **report.as_dict(),
                    "frames": engine.frames,
                    "share": round(engine.frames / total, 4) if total else 0.0,
                    "preprocess": engine.preprocess_choice.where,
                    "preprocess_reason": engine.preprocess_choice.reason,
                }
            )
        return rows

    def transition(self, new: ModelState) -> None:
        for engine in self.engines:
            with engine._lock:
                engine._transition_locked(new)

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
        """Stop taking new leases; close once in-flight batches have finished (every engine of the set)."""
        for peer in self.peers:
            peer._retire_one()
        self._retire_one()

    def close_all(self) -> None:
        """Close every engine's runner (a candidate that failed or was discarded, never swapped in)."""
        for engine in self.engines:
            engine.runner.close()

    def _retire_one(self) -> None:
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
        while any(e._leases > 0 or e._unpublished > 0 for e in self.engines):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True


def runs_of_model(model: LoadedModel) -> RunsInfo:
    """What ``model`` runs as (its source's report; the ONNX model as given when it has none)."""
    return model.source.runs or RunsInfo(source="model")


def _device_of(source: ModelSource) -> str:
    """Where a model that was not built by the agent runs: its first ONNX Runtime provider's device."""
    first = source.providers[0] if source.providers else "CPUExecutionProvider"
    name = first if isinstance(first, str) else first[0]
    return "cpu" if name == "CPUExecutionProvider" else "gpu"
