"""One deployment job: a manifest run once through download, verify, build and validate.

A :class:`Deployment` goes QUEUED -> DOWNLOADING -> VERIFYING -> BUILDING -> VALIDATING ->
[SHADOW] -> [PROBATION] -> ACTIVE (the bracketed steps when the manifest asks for them), or ends
FAILED / REJECTED / ROLLED_BACK / SUPERSEDED (:data:`JOB_TRANSITIONS`); every transition is first
recorded in the job ledger (``jobs.json``, atomically) and only then published as a
:class:`~agent.protocol.messages.JobStatus`, so a kill at any point can lose a publication but
never make a finished job run again. A ledger write that fails (a full state disk) ends the job
``FAILED disk_full``; the service retries it when space returns.
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import structlog

from agent.delivery.jobs.artifacts import fetch_artifacts, with_artifacts
from agent.delivery.jobs.reconcile import DISK_FULL
from agent.delivery.jobs.steps import (
    ActivateFn,
    ActivationRequest,
    BuildFn,
    FetchFn,
    GuardReporter,
    JobReporter,
)
from agent.delivery.jobs.targets import DeviceTarget
from agent.delivery.verify import verify_model
from agent.errors import AgentError, EngineError
from agent.protocol.delivery_errors import (
    DiskFullError,
    JobCancelledError,
    RolledBackError,
    TooLargeError,
    rejects,
)
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import (
    BuildProgressInfo,
    EvidenceSummary,
    JobState,
    JobStatus,
    ProbationFigures,
    ShadowFigures,
)
from agent.protocol.proving import ProbationSpec
from agent.protocol.runs import runs_of
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.store import ModelStore
from agent.transitions import TransitionTable

log = structlog.get_logger(__name__)

CancelReason = Literal["superseded", "stopping"]
#: Progress is published when it crosses another tenth (bounded spool traffic for any model size).
_PROGRESS_STEPS = 10
#: A write failing with one of these means the disk is full (a quota counts too).
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

_J = JobState
_STEPS = (_J.QUEUED, _J.DOWNLOADING, _J.VERIFYING, _J.BUILDING, _J.VALIDATING, _J.ACTIVE)
_FAILURES = frozenset({_J.FAILED, _J.REJECTED, _J.ROLLED_BACK, _J.SUPERSEDED})
#: One run of a job: each step to the next, any step to a failure end; the ends are final. SHADOW
#: and PROBATION are optional steps between VALIDATING and ACTIVE (either, both or neither).
JOB_TRANSITIONS = TransitionTable(
    JobState,
    {
        **{step: {after} | _FAILURES for step, after in itertools.pairwise(_STEPS)},
        # One of the device's own targets is applied and watched straight after its install.
        _J.BUILDING: {_J.VALIDATING, _J.PROBATION} | _FAILURES,
        _J.VALIDATING: {_J.SHADOW, _J.PROBATION, _J.ACTIVE} | _FAILURES,
        _J.SHADOW: {_J.PROBATION, _J.ACTIVE} | _FAILURES,
        _J.PROBATION: {_J.ACTIVE} | _FAILURES,
        **{end: frozenset() for end in _FAILURES | {_J.ACTIVE}},
    },
    kind="job",
)
#: The timing name of the step a job leaves (``validate`` for VALIDATING, as before).
_TIMING = {_J.VALIDATING: "validate", _J.SHADOW: "shadow", _J.PROBATION: "probation"}


class _ActivationFailedError(Exception):
    def __init__(self, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Deployment:
    """One manifest, run once through every step by :meth:`run` (on a slot worker thread)."""

    def __init__(
        self,
        manifest: DeployManifest,
        *,
        publish: Callable[[JobStatus], None],
        record: Callable[[JobStatus], None],
        store: ModelStore,
        fetch: FetchFn,
        build: BuildFn,
        activate: ActivateFn,
        part_dir: Path,
        max_bytes: int,
        headroom: int,
        preprocess: PreprocessSpec,
        postprocess: PostprocessSpec,
        protect: Callable[[], set[str]] = set,
        target: DeviceTarget | None = None,
    ) -> None:
        """``target``: the job is for one of the device's own targets (``manifest.slot`` names it):
        its verify, install and apply replace the model's verify, build and activate."""
        self.manifest = manifest
        self._target = target
        self._publish_fn = publish
        self._record_fn = record
        self._store = store
        self._fetch = fetch
        self._build = build
        self._activate = activate
        self._part_dir = part_dir
        self._max_bytes = max_bytes
        self._headroom = headroom
        self._protect = protect
        #: What the slot will run with this model (the manifest's, else the slot's current ones).
        self.preprocess = manifest.preprocess or preprocess
        self.postprocess = manifest.postprocess or postprocess
        self.cancel_event = threading.Event()
        self.cancel_reason: CancelReason | None = None
        self.superseded_by: str | None = None
        self.state = JobState.QUEUED
        self.timings: dict[str, float] = {}
        self.effective: dict[str, Any] | None = None
        self.error_code: str | None = None
        #: Figures of the guard phases, carried in every status from when they were measured.
        self.shadow: ShadowFigures | None = None
        self.probation: ProbationFigures | None = None
        self.evidence: EvidenceSummary | None = None
        self._step_started = time.monotonic()
        self._finished = False
        self._state_lock = threading.Lock()
        self._progress_step = -1
        self._build_fraction: float | None = None  # the last BUILDING progress published

    @property
    def job_id(self) -> str:
        return self.manifest.job_id

    @property
    def requested(self) -> dict[str, Any] | None:
        """The manifest's build request as published (None: no engine build asked)."""
        build = self.manifest.build
        return build.model_dump(mode="json", exclude_none=True) if build is not None else None

    # -- publishing ------------------------------------------------------------------------------

    def _status(self, state: JobState, **fields: Any) -> JobStatus:
        status = JobStatus(
            job_id=self.job_id,
            slot=self.manifest.slot,
            state=state,
            timings_s=dict(self.timings),
            requested=self.requested,
            effective=self.effective,
            runs=runs_of(self.effective) if self.effective is not None else None,
            shadow=self.shadow,
            probation=self.probation,
            evidence=self.evidence,
            **fields,
        )
        log.info(
            "delivery.job.state",
            job=self.job_id,
            slot=self.manifest.slot,
            state=state.value,
            error_code=fields.get("error_code"),
            error=fields.get("error"),
        )
        return status

    def _publish(self, state: JobState, **fields: Any) -> None:
        """Publish a progress update within the current state (not recorded: the state is)."""
        self._publish_fn(self._status(state, **fields))

    def _enter(self, state: JobState, **fields: Any) -> None:
        """Record ``state`` in the ledger, then publish it (DiskFullError when it cannot be recorded)."""
        with self._state_lock:
            if self._finished:
                return
            if state is not self.state:
                JOB_TRANSITIONS.check(self.state, state, who=f"job {self.job_id}")
            self.state = state
            self._progress_step = -1
        status = self._status(state, **fields)
        try:
            self._record_fn(status)
        except OSError as exc:
            raise DiskFullError(
                f"cannot record job {self.job_id} in the job ledger (jobs.json): {exc}; free space on "
                "the state disk: the device retries the job when space returns"
            ) from exc
        self._publish_fn(status)

    def queued(self) -> None:
        """Record and publish QUEUED (when the service accepts the manifest); DiskFullError if the
        ledger cannot be written (nothing was published then)."""
        self._enter(JobState.QUEUED, bytes_done=0, bytes_total=self.manifest.size, progress=0.0)

    def finish(self, state: JobState, *, error_code: str | None = None, error: str | None = None) -> bool:
        """Record, then publish the terminal ``state`` once; False if the job had already finished.

        A terminal state that cannot be recorded (disk full) is published all the same: it is true
        now, and the operator must hear it. Until the record is written, a restart resumes the job.
        """
        with self._state_lock:
            if self._finished:
                return False
            JOB_TRANSITIONS.check(self.state, state, who=f"job {self.job_id}")
            self._finished = True
            self.state = state
            self.error_code = error_code
        status = self._status(state, error_code=error_code, error=error)
        try:
            self._record_fn(status)
        except OSError as exc:
            log.error("delivery.job.record_failed", job=self.job_id, state=state.value, error=str(exc))
        self._publish_fn(status)
        return True

    def _on_bytes(self, done: int, total: int) -> None:
        total = total or self.manifest.size
        fraction = min(1.0, done / total) if total else 1.0
        step = int(fraction * _PROGRESS_STEPS)
        if step <= self._progress_step or self.state is not JobState.DOWNLOADING:
            return
        self._progress_step = step
        self._publish(JobState.DOWNLOADING, bytes_done=done, bytes_total=total, progress=fraction)

    def _on_build_progress(self, fraction: float) -> None:
        step = int(fraction * _PROGRESS_STEPS)
        if step <= self._progress_step or self.state is not JobState.BUILDING:
            return
        self._progress_step = step
        self._build_fraction = fraction
        self._publish(JobState.BUILDING, progress=fraction)

    def _on_build_phase(self, info: dict[str, object]) -> None:
        if self.state is not JobState.BUILDING:
            return
        # The same fraction as the last progress update: a build update never moves progress back.
        fraction = self._build_fraction
        self._publish(JobState.BUILDING, progress=fraction, build=BuildProgressInfo.model_validate(info))

    # -- control ---------------------------------------------------------------------------------

    def cancel(self, reason: CancelReason, superseded_by: str | None = None) -> None:
        """Ask the job to stop at its next step boundary (a fetch stops at once)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self.superseded_by = superseded_by
        self.cancel_event.set()

    def _check_cancel(self) -> None:
        if self.cancel_event.is_set():
            raise JobCancelledError(f"job {self.job_id} cancelled ({self.cancel_reason})")

    # -- the steps -------------------------------------------------------------------------------

    def run(self) -> JobState | None:
        """Run every step; return the terminal state, or None when stopped for an agent shutdown
        (the job stays unfinished and resumes when the retained manifest arrives again)."""
        try:
            self._run_steps()
        except JobCancelledError:
            if self.cancel_reason == "stopping":
                log.info("delivery.job.interrupted", job=self.job_id, state=self.state.value)
                return None
            self.finish(
                JobState.SUPERSEDED,
                error_code="superseded",
                error=f"superseded by job {self.superseded_by}" if self.superseded_by else "superseded",
            )
        except RolledBackError as exc:
            self._timed(_TIMING.get(self.state, "validate"), self._step_started)
            self.finish(JobState.ROLLED_BACK, error_code=exc.code, error=str(exc))
        except _ActivationFailedError as exc:
            self.finish(
                JobState.ROLLED_BACK,
                error_code=exc.cause.code,
                error=f"new model failed to load or validate; the previous one keeps serving: {exc.cause}",
            )
        except AgentError as exc:
            self.finish(
                JobState.REJECTED if rejects(exc) else JobState.FAILED, error_code=exc.code, error=str(exc)
            )
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                log.exception("delivery.job.crashed", job=self.job_id)
                self.finish(JobState.FAILED, error_code="internal_error", error=repr(exc))
            else:
                self.finish(
                    JobState.FAILED, error_code=DISK_FULL, error=f"{exc}; free space on the state disk"
                )
        except Exception as exc:  # a bug or a library surprise must fail the job, not the worker
            log.exception("delivery.job.crashed", job=self.job_id)
            self.finish(JobState.FAILED, error_code="internal_error", error=repr(exc))
        return self.state

    def _timed(self, step: str, started: float) -> None:
        self.timings[step] = round(time.monotonic() - started, 6)

    def _run_steps(self) -> None:
        m = self.manifest
        self._check_cancel()
        if m.size > self._max_bytes:
            raise TooLargeError(
                f"manifest announces {m.size} bytes, more than delivery.max_model_bytes={self._max_bytes}; "
                "raise the limit or deploy a smaller model",
                job_id=m.job_id,
            )
        present = self._store.has(m.sha256)
        self._store.check_free_space(0 if present else m.size, self._headroom)

        started = time.monotonic()
        self._enter(JobState.DOWNLOADING, bytes_done=0, bytes_total=m.size, progress=0.0)
        if present:
            self._store.touch(m.sha256)
            self._on_bytes(m.size, m.size)
            fetched = None
        else:
            self._part_dir.mkdir(parents=True, exist_ok=True)
            try:
                fetched = self._fetch(m, self._part_dir, self._on_bytes, self.cancel_event)
            except Exception as exc:
                if self.cancel_event.is_set():
                    raise JobCancelledError(f"download of job {self.job_id} cancelled") from exc
                raise
        # The build's extra files (an INT8 calibration), fetched and verified the same way.
        artifacts = fetch_artifacts(
            m,
            ModelStore(self._store.root.parent / "artifacts"),
            fetch=self._fetch,
            part_dir=self._part_dir,
            cancel=self.cancel_event,
            max_bytes=self._max_bytes,
            protect=self._protect(),
            held=self._target.held() if self._target is not None else (),
        )
        self._check_cancel()
        self._timed("download", started)

        started = time.monotonic()
        self._enter(JobState.VERIFYING)
        model = (
            self._store.adopt(fetched, m.sha256) if fetched is not None else self._store.path_for(m.sha256)
        )
        if self._target is not None:
            self._run_target(self._target, model, artifacts, started)
            return
        verify_model(
            model, m, max_bytes=self._max_bytes, preprocess=self.preprocess, postprocess=self.postprocess
        )
        self._timed("verify", started)
        self._check_cancel()

        started = time.monotonic()
        self._enter(JobState.BUILDING)
        reporter = self._reporter(
            preprocess=m.preprocess, on_build=self._on_build_phase, share_engines=bool(m.share_engines)
        )
        outcome = self._build(model, with_artifacts(m.build, artifacts), reporter)
        self.effective = dict(outcome.effective) or {"backend": outcome.backend}
        self._timed("build", started)
        self._check_cancel()

        started = time.monotonic()
        self._enter(JobState.VALIDATING)
        request = ActivationRequest(
            slot=m.slot,
            engine_path=outcome.engine_path,
            backend=outcome.backend,
            load_extra=dict(outcome.load_extra),
            providers=outcome.providers,
            model_id=m.model_id,
            version=m.version,
            sha256=m.sha256,
            model_path=model,
            preprocess=m.preprocess,
            postprocess=m.postprocess,
            shadow=m.shadow,
            probation_s=m.probation_s or 0.0,
            probation=m.probation or ProbationSpec(),
            guard=GuardReporter(
                self._enter_guard,
                self._guard_figures,
                self.cancel_event,
                job_id=self.job_id,
                evidence=self._kept_evidence,
            ),
            on_fallback=self._fell_back,
            share_engines=bool(m.share_engines),
            rollback=bool(m.rollback),
        )
        self._step_started = started
        try:
            self._activate(request)
        except EngineError as exc:
            self._timed("validate", started)
            raise _ActivationFailedError(exc) from exc
        except AgentError:
            self._timed(_TIMING.get(self.state, "validate"), self._step_started)
            raise
        self._timed(_TIMING.get(self.state, "validate"), self._step_started)
        self.finish(JobState.ACTIVE)

    def _reporter(self, **model_build: Any) -> JobReporter:
        """What the BUILDING step reports through: this job's progress, cancel and names (a model's
        build adds its preprocessing, build phases and engine sharing)."""
        m = self.manifest
        return JobReporter(
            self._on_build_progress,
            self.cancel_event,
            slot=m.slot,
            job_id=m.job_id,
            model_id=m.model_id,
            version=m.version,
            **model_build,
        )

    def _run_target(
        self, target: DeviceTarget, document: Path, artifacts: dict[str, Path], started: float
    ) -> None:
        """VERIFYING -> BUILDING (install) -> PROBATION (apply, through the guard) -> ACTIVE."""
        m = self.manifest
        target.verify(document, m)
        self._timed("verify", started)
        self._check_cancel()

        started = time.monotonic()
        self._enter(JobState.BUILDING)
        reporter = self._reporter()
        target.install(document, artifacts, m, reporter)
        self._timed("build", started)
        self._check_cancel()

        self._step_started = time.monotonic()
        guard = GuardReporter(self._enter_guard, self._guard_figures, self.cancel_event, job_id=self.job_id)
        try:
            target.apply(document, m, guard)
        except AgentError:
            self._timed(_TIMING.get(self.state, "build"), self._step_started)
            raise
        self._timed(_TIMING.get(self.state, "build"), self._step_started)
        self.finish(JobState.ACTIVE)

    # -- the guard phases (called by the runtime from inside activate) ---------------------------

    def _fell_back(self, effective: dict[str, Any]) -> None:
        """The runtime rebuilt the engine on ONNX Runtime (the TensorRT one failed to load): every
        status from now on, ACTIVE included, says what the slot really runs and why."""
        self.effective = dict(effective)
        self._publish(self.state)

    def _enter_guard(self, state: JobState) -> None:
        self._timed(_TIMING.get(self.state, "validate"), self._step_started)
        self._step_started = time.monotonic()
        self._enter(state)

    def _kept_evidence(self, summary: EvidenceSummary) -> None:
        """Carried by the job's statuses from now on (the terminal one included); not published alone."""
        self.evidence = summary

    def _guard_figures(self, shadow: ShadowFigures | None, probation: ProbationFigures | None) -> None:
        if shadow is not None:
            self.shadow = shadow
        if probation is not None:
            self.probation = probation
        self._publish(self.state)
