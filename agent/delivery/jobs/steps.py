"""The collaborators a deployment job calls, as types: fetch, build, activate.

The composition root (:mod:`agent.app.root`) wires the real ones: ``fetch_model`` from
:mod:`agent.delivery.transfer.pull`, the engine builder, and the slot activation. Keeping them as
plain callables lets the job runner be tested with real files and a real broker and no TensorRT.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.backends.base import ProviderRequest
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import EvidenceSummary, JobState, ProbationFigures, ShadowFigures
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

#: Called by a fetch with ``(bytes_done, bytes_total)`` as the download advances.
ProgressFn = Callable[[int, int], None]

#: ``fetch(manifest, part_dir, progress, cancel) -> complete file``. Raises DeliveryError on failure;
#: returns promptly (raising anything) once ``cancel`` is set. The file it returns is not yet
#: hash-checked as a whole: the job moves it into the store, which checks.
FetchFn = Callable[[DeployManifest, Path, ProgressFn, threading.Event], Path]


class JobReporter:
    """What a long step (an engine build) may use to report progress and notice cancellation."""

    def __init__(
        self,
        on_progress: Callable[[float], None],
        cancel: threading.Event,
        *,
        slot: str | None = None,
        preprocess: PreprocessSpec | None = None,
        on_build: Callable[[dict[str, object]], None] | None = None,
        share_engines: bool = False,
        job_id: str | None = None,
        model_id: str | None = None,
        version: str | None = None,
    ) -> None:
        self._on_progress = on_progress
        self._on_build = on_build
        #: The slot the engine is for, and the manifest's preprocessing (None: the slot's own).
        self.slot = slot
        self.preprocess = preprocess
        #: Set when the job should stop (superseded, agent stopping): a builder checks it between steps.
        self.cancel = cancel
        #: The manifest asks to take the engine from the fleet on a cache miss (docs/engines.md).
        self.share_engines = share_engines
        self.job_id = job_id
        #: The model and version the job delivers (a fleet ask names them to the controller).
        self.model_id = model_id
        self.version = version

    def progress(self, fraction: float) -> None:
        """Report the step as ``fraction`` (0..1) done; published, rate-limited, in job status."""
        self._on_progress(min(1.0, max(0.0, float(fraction))))

    def build(self, info: dict[str, object]) -> None:
        """Report the build's phase, frames, elapsed and estimate (``JobStatus.build``); the caller
        bounds the rate (agent.engines.building.progress)."""
        if self._on_build is not None:
            self._on_build(info)


@dataclass(frozen=True)
class BuildOutcome:
    """What a build produced: the engine file, the backend that loads it, and what it effectively did."""

    engine_path: Path
    backend: str
    effective: dict[str, Any] = field(default_factory=dict)
    #: Backend-specific load settings (e.g. the DLA core) for :class:`agent.backends.base.LoadOptions.extra`.
    load_extra: dict[str, Any] = field(default_factory=dict)
    #: ONNX Runtime providers the engine was built for (empty: the slot's own).
    providers: tuple[ProviderRequest, ...] = ()


#: ``build(model, spec, reporter) -> BuildOutcome``; raises BuildError on failure.
BuildFn = Callable[[Path, "BuildSpec | None", JobReporter], BuildOutcome]


def no_build(model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
    """The default builder: no engine, the ONNX model itself on ONNX Runtime (CPU)."""
    reporter.progress(1.0)
    return BuildOutcome(
        engine_path=model,
        backend="onnxruntime",
        effective={"backend": "onnxruntime", "precision": "fp32", "device": "cpu"},
    )


class GuardReporter:
    """How the slot activation tells the job where a guarded activation stands (SHADOW, PROBATION).

    The runtime calls :meth:`enter` when a phase starts and :meth:`figures` as measurements come in;
    the job records and publishes them. ``cancel`` is the job's: set when it is superseded or the
    agent stops, and the runtime ends the phase at once (swapping back if the new model serves).
    """

    def __init__(
        self,
        enter: Callable[[JobState], None],
        figures: Callable[[ShadowFigures | None, ProbationFigures | None], None],
        cancel: threading.Event,
        *,
        job_id: str = "",
        evidence: Callable[[EvidenceSummary], None] | None = None,
    ) -> None:
        self._enter = enter
        self._figures = figures
        self.cancel = cancel
        #: The job's id: what the device files a rejection's evidence frames under.
        self.job_id = job_id
        self._evidence = evidence

    def enter(self, state: JobState) -> None:
        """The job moves to ``state`` (SHADOW or PROBATION); recorded, then published."""
        self._enter(state)

    def figures(self, shadow: ShadowFigures | None = None, probation: ProbationFigures | None = None) -> None:
        """New figures for the job status (published as progress within the current state)."""
        self._figures(shadow, probation)

    def evidence(self, summary: EvidenceSummary) -> None:
        """The runtime kept evidence frames for this job: its final status says how many."""
        if self._evidence is not None:
            self._evidence(summary)


@dataclass(frozen=True)
class ActivationRequest:
    """Load this engine into a slot, validate it off the frame path, swap it in.

    ``preprocess``/``postprocess`` None keep the slot's current ones. ``shadow`` and a positive
    ``probation_s`` guard the swap (reported through ``guard``): the runtime raises
    :class:`~agent.protocol.delivery_errors.ShadowRejectedError` or
    :class:`~agent.protocol.delivery_errors.RolledBackError`.
    """

    slot: str
    engine_path: Path
    backend: str
    load_extra: dict[str, Any]
    model_id: str
    version: str
    sha256: str
    model_path: Path
    providers: tuple[ProviderRequest, ...] = ()
    preprocess: PreprocessSpec | None = None
    postprocess: PostprocessSpec | None = None
    shadow: ShadowSpec | None = None
    probation_s: float = 0.0
    probation: ProbationSpec = field(default_factory=ProbationSpec)
    guard: GuardReporter | None = None
    #: Told the new ``effective`` report when the runtime replaced the built engine (a TensorRT
    #: engine that failed to load, rebuilt on ONNX Runtime): the job publishes what it now runs.
    on_fallback: Callable[[dict[str, Any]], None] | None = None
    #: The manifest lets the device offer the engine it built to the fleet once it is ACTIVE.
    share_engines: bool = False
    #: The manifest moves the slot back (``rollback``): recorded as a rollback, leaving no target.
    rollback: bool = False


#: ``activate(request)``; raises :class:`agent.errors.EngineError` when the candidate fails to load or
#: validate (the old model keeps serving; the job ends ROLLED_BACK).
ActivateFn = Callable[[ActivationRequest], None]

#: The slot's current pre/postprocessing, or None when the device has no such slot.
SlotSpecsFn = Callable[[str], "tuple[PreprocessSpec, PostprocessSpec] | None"]
