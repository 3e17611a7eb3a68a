"""``ModelSlot``: one model at a time, loaded and validated off the frame path, swapped atomically.

Slot states (one table, changed under a lock, every change logged and counted):
EMPTY -> LOADING -> VALIDATING -> ACTIVE; a later load goes ACTIVE -> LOADING -> VALIDATING ->
ACTIVE while the old model keeps serving; a failed load returns to the state it came from
(ACTIVE with the old model, or EMPTY).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.backends.base import LoadOptions, Runner, get_backend
from agent.camera.gpu_preprocess import gpu_preprocessor_for
from agent.camera.preprocess import preprocess
from agent.errors import AgentError, EngineError
from agent.fsutil import sha256_file
from agent.model_contract.input_fit import check_input_fits, select_input
from agent.model_contract.outputs import validate_outputs
from agent.postprocess.runner import Postprocessor
from agent.protocol.messages import ModelRef
from agent.runtime.slots.loaded import LoadedModel, ModelSource, ModelState, runs_of_model
from agent.transitions import TransitionTable

log = structlog.get_logger(__name__)


class SlotState(str, Enum):
    EMPTY = "empty"
    LOADING = "loading"
    VALIDATING = "validating"
    ACTIVE = "active"


SLOT_TRANSITIONS = TransitionTable(
    SlotState,
    {
        SlotState.EMPTY: frozenset({SlotState.LOADING}),
        SlotState.LOADING: frozenset({SlotState.VALIDATING, SlotState.EMPTY, SlotState.ACTIVE}),
        SlotState.VALIDATING: frozenset({SlotState.ACTIVE, SlotState.EMPTY}),
        SlotState.ACTIVE: frozenset({SlotState.LOADING, SlotState.EMPTY}),  # EMPTY: closed at shutdown
    },
)

#: Called with (slot name, old state, new state) on every slot transition.
SlotListener = Callable[[str, SlotState, SlotState], None]


def _grey_frame(width: int, height: int) -> npt.NDArray[np.uint8]:
    return np.full((height, width, 3), 114, dtype=np.uint8)


class ModelSlot:
    """A named place for one model; streams read ``lease()`` per batch."""

    def __init__(
        self, name: str, *, on_transition: SlotListener | None = None, parallel_runs: int = 1
    ) -> None:
        self.name = name
        #: Inference workers that run this slot's model side by side (the backend sizes its threads by it).
        self.parallel_runs = parallel_runs
        self._state = SlotState.EMPTY
        self._current: LoadedModel | None = None
        self._lock = threading.Lock()
        # One load at a time per slot: a second reload waits for the first to finish.
        self._load_lock = threading.Lock()
        self._on_transition = on_transition
        self.swaps = 0
        self.failed_loads = 0
        self.last_error: str | None = None
        #: Why the slot holds no model (None while it serves one); up/info and the status line show
        #: it, so an empty slot says what to fix instead of just serving nothing.
        self.empty_reason: str | None = "no model loaded yet"

    @property
    def state(self) -> SlotState:
        return self._state

    @property
    def current(self) -> LoadedModel | None:
        return self._current

    def _transition(self, new: SlotState) -> None:
        with self._lock:
            old = self._state
            SLOT_TRANSITIONS.check(old, new, who=f"slot {self.name}")
            self._state = new
        log.info("slot.state", slot=self.name, old=old.value, new=new.value)
        if self._on_transition is not None:
            self._on_transition(self.name, old, new)

    @contextmanager
    def lease(self, worker: int = 0) -> Iterator[LoadedModel | None]:
        """The engine inference worker ``worker`` runs its next batch on; it stays open until the
        block ends. Taken under the slot lock, so it always comes from one set, the current one."""
        model = self.acquire(worker)
        try:
            yield model
        finally:
            if model is not None:
                model.release()

    def acquire(self, worker: int = 0) -> LoadedModel | None:
        """:meth:`lease` without the context manager, for the per-batch loop (a generator-based
        ``with`` costs more than the batch's own bookkeeping): the caller calls ``release()``."""
        with self._lock:
            model = self._current.engine_for(worker) if self._current is not None else None
            if model is not None:
                model.acquire()
        return model

    def load(
        self,
        source: ModelSource,
        sample: npt.NDArray[np.uint8] | None = None,
        *,
        before_swap: Callable[[LoadedModel], None] | None = None,
    ) -> LoadedModel:
        """Load, warm up and validate ``source`` off the frame path, then swap it in.

        On any failure the previous model keeps serving and :class:`EngineError` says why.
        ``sample`` is a real camera frame to validate on; a grey frame is used when none is known yet.
        ``before_swap(candidate)`` runs once the candidate passed, before it serves (the state.json
        record of a deployment): when it raises, the candidate is dropped, the previous model keeps
        serving and its exception propagates unchanged.
        """
        with self._load_lock:
            candidate = self._validated(source, sample)
            if before_swap is not None:
                try:
                    before_swap(candidate)
                except BaseException:
                    self.discard(candidate)
                    self._transition(SlotState.ACTIVE if self._current is not None else SlotState.EMPTY)
                    raise
            self._swap(candidate)
            return candidate

    def load_candidate(self, source: ModelSource, sample: npt.NDArray[np.uint8] | None = None) -> LoadedModel:
        """Load and validate ``source`` like :meth:`load`, but do not swap it in: the current model
        keeps serving (the slot returns to ACTIVE) and the candidate waits, VALIDATING, for a shadow
        run. The caller swaps it in with :meth:`swap_in` or drops it with :meth:`discard`."""
        with self._load_lock:
            candidate = self._validated(source, sample)
            self._transition(SlotState.ACTIVE if self._current is not None else SlotState.EMPTY)
            return candidate

    def _validated(self, source: ModelSource, sample: npt.NDArray[np.uint8] | None) -> LoadedModel:
        before = self._state
        self._transition(SlotState.LOADING)
        candidate: LoadedModel | None = None
        try:
            candidate = self._open(source)
            candidate.transition(ModelState.VALIDATING)
            self._transition(SlotState.VALIDATING)
            for engine in candidate.engines:  # every engine of a set must pass before any serves
                validate_candidate(engine, sample)
        except AgentError as exc:
            self._fail(source, candidate, before, exc)
            raise EngineError(f"slot {self.name}: model {source.path} rejected: {exc}") from exc
        except Exception as exc:  # a framework raising something unexpected must not kill the agent
            self._fail(source, candidate, before, exc)
            raise EngineError(f"slot {self.name}: model {source.path} rejected: {exc!r}") from exc
        return candidate

    def discard(self, candidate: LoadedModel) -> None:
        """Drop a candidate that was never swapped in (its shadow run refused it)."""
        candidate.transition(ModelState.FAILED)
        candidate.close_all()

    def swap_in(self, candidate: LoadedModel) -> LoadedModel | None:
        """Swap a validated candidate in and return the previous model, kept loaded (not retired):
        probation may swap back to it without a load, so without losing a frame."""
        candidate.transition(ModelState.ACTIVE)
        with self._lock:
            previous, self._current = self._current, candidate
        self.swaps += 1
        log.info("slot.swapped", slot=self.name, model=candidate.ref.model_id, version=candidate.ref.version)
        return previous

    def swap_back(self, previous: LoadedModel, rejected: LoadedModel) -> None:
        """Serve ``previous`` again (a reference swap) and retire ``rejected`` once its batches end."""
        with self._lock:
            self._current = previous
        self.swaps += 1
        rejected.retire()
        log.warning(
            "slot.swapped_back", slot=self.name, model=previous.ref.model_id, version=previous.ref.version
        )

    def _open(self, source: ModelSource) -> LoadedModel:
        """The model of ``source``: one engine, or a set when ``source.engines`` names more devices."""
        first = self._open_one(source)
        peers: list[LoadedModel] = []
        try:
            for engine_source in source.engines:
                peer = self._open_one(engine_source, ref=first.ref)
                # One set, one health record: probation judges the set, not one engine's share.
                peer.health = first.health
                peers.append(peer)
        except BaseException:
            first.close_all()
            for peer in peers:
                peer.runner.close()
            raise
        first.peers = tuple(peers)
        return first

    def _open_one(self, source: ModelSource, ref: ModelRef | None = None) -> LoadedModel:
        options = LoadOptions(
            providers=source.providers,
            intra_op_threads=source.intra_op_threads,
            parallel_runs=self.parallel_runs,
            extra={"allow_spinning": source.allow_spinning, **dict(source.extra)},
        )
        runner = get_backend(source.backend).load(source.path, options)
        try:
            postprocessor = Postprocessor(source.postprocess, base_dir=source.base_dir)  # type: ignore[arg-type]
            input_name = _input_name(runner, source)
            ref = ref or ModelRef(
                slot=self.name,
                model_id=source.model_id,
                version=source.version,
                sha256=source.sha256 or sha256_file(source.path),
            )
            preprocessor, choice = gpu_preprocessor_for(runner.describe(), source.preprocess)
        except BaseException:
            runner.close()
            raise
        if preprocessor is None and choice.reason.startswith("GPU preprocessing"):
            log.warning("slot.preprocess.cpu_fallback", slot=self.name, reason=choice.reason)
        return LoadedModel(
            source=source,
            ref=ref,
            runner=runner,
            postprocessor=postprocessor,
            input_name=input_name,
            gpu_preprocessor=preprocessor,
            preprocess_choice=choice,
        )

    def _fail(
        self, source: ModelSource, candidate: LoadedModel | None, before: SlotState, exc: BaseException
    ) -> None:
        self.failed_loads += 1
        self.last_error = str(exc)
        if before is not SlotState.ACTIVE:
            self.empty_reason = f"model {source.path} failed to load: {exc}"
        if candidate is not None:
            candidate.transition(ModelState.FAILED)
            candidate.close_all()
        self._transition(SlotState.ACTIVE if before is SlotState.ACTIVE else SlotState.EMPTY)
        log.error("slot.load.failed", slot=self.name, error=str(exc))

    def _swap(self, candidate: LoadedModel) -> None:
        candidate.transition(ModelState.ACTIVE)
        with self._lock:
            old, self._current = self._current, candidate
        self.empty_reason = None
        self._transition(SlotState.ACTIVE)
        if old is not None:
            self.swaps += 1
            old.retire()
        log.info("slot.swapped", slot=self.name, model=candidate.ref.model_id, version=candidate.ref.version)

    def close(self) -> None:
        """Release the current model (at shutdown, after the frame path has stopped)."""
        # Not under the load lock: a build still running at shutdown must not hold the stop up.
        with self._lock:
            old, self._current = self._current, None
        if old is not None:
            old.retire()
            self.empty_reason = "agent stopping"
        if self._state is SlotState.ACTIVE:
            self._transition(SlotState.EMPTY)

    def describe(self) -> dict[str, Any]:
        model = self._current
        return {
            "state": self._state.value,
            "model": model.ref.model_dump() if model else None,
            "runner": model.runner.describe() if model else None,
            "engines": model.engine_shares() if model else [],
            "runs": runs_of_model(model).model_dump(mode="json", exclude_none=True) if model else None,
            "swaps": self.swaps,
            "failed_loads": self.failed_loads,
            "last_error": self.last_error,
            "empty_reason": self.empty_reason,
        }


def _input_name(runner: Runner, source: ModelSource) -> str:
    return select_input(source.preprocess, runner.inputs).name


def validate_candidate(model: LoadedModel, sample: npt.NDArray[np.uint8] | None) -> None:
    """Warm up and check a model on a real frame: input fits, outputs fit postprocessing and are finite."""
    spec = model.preprocess
    runner = model.runner
    in_spec = next(s for s in runner.inputs if s.name == model.input_name)
    check_input_fits(spec, in_spec)
    validate_outputs(model.source.postprocess, runner.outputs)  # type: ignore[arg-type]
    image = sample if sample is not None else _grey_frame(max(spec.width, 64), max(spec.height, 64))
    tensor, letterbox = preprocess(image, spec)
    outputs = runner.infer({model.input_name: tensor[np.newaxis]})
    for name, array in outputs.items():
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise EngineError(f"output {name!r} has NaN or infinite values on a real frame")
    model.postprocessor({name: array[0] for name, array in outputs.items()}, letterbox)
