"""The interface every inference backend implements, and the registry that chooses one by key.

A backend turns an engine file (an ONNX model for ONNX Runtime, a serialized plan for TensorRT)
into a :class:`Runner`. Framework imports happen inside each backend module, lazily, so the rest of
the agent imports and runs without them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt

from agent.errors import EngineError
from agent.model_contract.tensors import TensorSpec

#: A model faster than this per frame (batch 1, on the CPU provider) gets one intra-op thread when
#: the thread count is left to the agent (``intra_op_threads: 0``). Splitting a sub-millisecond run
#: over every core costs more in thread wake-ups than it saves, and those cores are what the capture
#: threads need to decode the next frames (measured in bench/pipeline.py: the "tiny" case).
#: A slot fed by unpaced files also keeps such a model on one inference worker (agent.runtime.frames.layout).
SMALL_MODEL_MS = 1.5

#: An ONNX Runtime provider: a name, or ``(name, options)``.
ProviderRequest = str | tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class LoadOptions:
    """What the runtime asks of a backend when it loads an engine.

    ``providers`` is the ONNX Runtime provider list (names or ``(name, options)`` pairs), ignored
    by other backends; ``extra`` carries backend-specific settings (DLA core for TensorRT).
    """

    providers: tuple[ProviderRequest, ...] = ("CPUExecutionProvider",)
    intra_op_threads: int = 0
    #: Runs of this engine the pipeline makes side by side (its inference workers): a backend that
    #: sizes its own thread pool divides the cores by it instead of giving every run all of them.
    parallel_runs: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)


Feeds = Mapping[str, npt.NDArray[Any]]
Outputs = dict[str, npt.NDArray[Any]]


class Runner(ABC):
    """A loaded engine that runs inference; safe to call from one thread at a time.

    The public ``infer`` validates the feeds against :attr:`inputs`, then calls ``_infer``; so a
    malformed batch is an :class:`EngineError` naming the tensor, never a crash inside a framework.
    """

    #: Registry key of the backend that made this runner.
    backend: str = ""

    def __init__(self, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        #: Milliseconds of one batch-1 run as loaded, when the backend measured it at load time.
        self.probe_ms: float | None = None
        #: The whole run executes on the calling thread (no worker threads, no device): that thread's
        #: CPU time is then the run's cost, which neither other processes nor the GIL inflate.
        self.runs_on_caller = False
        self._closed = False

    def infer(self, feeds: Feeds) -> Outputs:
        """Run one batch. Feeds map input names to arrays whose first axis is the batch."""
        if self._closed:
            raise EngineError(f"{self.backend} runner is closed")
        for spec in self.inputs:
            array = feeds.get(spec.name)
            if array is None:
                raise EngineError(f"input {spec.name!r} is missing from the feeds")
            if array.ndim != len(spec.shape):
                raise EngineError(
                    f"input {spec.name!r} has {array.ndim} dimensions, the model expects {len(spec.shape)}"
                )
            for axis, (got, want) in enumerate(zip(array.shape, spec.shape, strict=True)):
                if isinstance(want, int) and want > 0 and got != want and axis > 0:
                    raise EngineError(f"input {spec.name!r} axis {axis} is {got}, the model expects {want}")
        return self._infer(feeds)

    @abstractmethod
    def _infer(self, feeds: Feeds) -> Outputs: ...

    def close(self) -> None:
        """Release the engine's memory. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:  # noqa: B027 - optional hook, most runners free on garbage collection
        """Backend hook for :meth:`close`."""

    def describe(self) -> dict[str, Any]:
        """What the backend effectively runs on (providers, device, precision), for status reports."""
        return {"backend": self.backend}

    def on_caller(self) -> Runner | None:
        """A runner of the same engine whose runs execute wholly on the calling thread (what a pair
        is timed on by CPU time): this one when it already does, a new one (the caller closes it)
        where the backend can make it, else None."""
        return self if self.runs_on_caller else None

    @property
    def max_batch(self) -> int | None:
        """Largest batch the first input accepts, or None when its batch axis is dynamic."""
        first = self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else None
        return first if isinstance(first, int) and first > 0 else None


class Backend(ABC):
    """A factory of runners for one engine format."""

    key: str = ""

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """Whether this backend can run here, and why not when it cannot (one line)."""

    @abstractmethod
    def load(self, engine: Path, options: LoadOptions) -> Runner:
        """Load an engine file; raise :class:`EngineError` with the reason on failure."""


#: Registry of backends by key. Values are "module:Class" so nothing heavy is imported to list them.
BACKENDS: dict[str, str] = {
    "onnxruntime": "agent.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "agent.backends.tensorrt:TensorRTBackend",
}


def get_backend(key: str) -> Backend:
    """Instantiate the backend registered under ``key``."""
    try:
        target = BACKENDS[key]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise EngineError(f"unknown backend {key!r}; known backends: {known}") from None
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    backend: Backend = getattr(module, class_name)()
    return backend
