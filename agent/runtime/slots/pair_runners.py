"""The runners a probation's or a shadow's pairs run on: each model's own where its runs execute on
the calling thread, else a copy of it that does, so both runs of a pair are timed by CPU time.

A model given a thread pool (ONNX Runtime on the CPU with several intra-op threads) does part of
each run on other threads, which the calling thread's CPU time leaves out; its wall time counts
whatever else the machine did meanwhile (:mod:`agent.runtime.slots.latency`). For the pairs alone the
same engine is loaded once more with one thread (``Runner.on_caller``), while the model's own runner
keeps serving frames as loaded. Where no such copy can be made (a GPU or DLA engine, or a load that
failed) the model's own runner is used and the pair holds wall times, as before.
"""

from __future__ import annotations

import structlog

from agent.backends.base import Runner
from agent.errors import AgentError
from agent.runtime.slots.loaded import LoadedModel

log = structlog.get_logger(__name__)


class PairRunners:
    """Per model, the runner its pairs run on; made at the first pair, closed by :meth:`close`."""

    def __init__(self) -> None:
        # Keyed by identity: the model is held here too, so its id stays its own until close.
        self._made: dict[int, tuple[LoadedModel, Runner]] = {}

    def __call__(self, model: LoadedModel) -> Runner:
        made = self._made.get(id(model))
        if made is not None:
            return made[1]
        runner = _on_caller(model)
        self._made[id(model)] = (model, runner)
        return runner

    def close(self) -> None:
        """Close the copies made (the models' own runners stay theirs)."""
        for model, runner in self._made.values():
            if runner is not model.runner:
                runner.close()
        self._made.clear()


def _on_caller(model: LoadedModel) -> Runner:
    try:
        copy = model.runner.on_caller()
    except AgentError as exc:
        log.warning("pair.runner_not_made", model=model.ref.model_id, error=str(exc))
        return model.runner
    if copy is None:
        return model.runner
    if copy is not model.runner:
        log.info("pair.runner_made", model=model.ref.model_id, version=model.ref.version)
    return copy
