"""Deployment jobs: one manifest through download, verify, build and validate, and the service
that reconciles desired state into jobs.

A :class:`Deployment` goes QUEUED -> DOWNLOADING -> VERIFYING -> BUILDING -> VALIDATING -> ACTIVE,
or ends FAILED / REJECTED / ROLLED_BACK / SUPERSEDED; every transition is published as a
:class:`~agent.protocol.messages.JobStatus` through the durable spool. :class:`DeliveryService`
subscribes to ``down/desired/+`` and ``down/cmd/+``, decides per manifest (:mod:`.reconcile`), and
runs one job at a time per slot on a worker thread of that slot: the MQTT dispatcher thread only
parses, decides and hands over.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import structlog

from agent.camera.preprocess_spec import PreprocessSpec
from agent.delivery.commands import BadArgsError, CommandHandler, CommandRouter
from agent.delivery.errors import JobCancelledError, ReplayError, TooLargeError, WrongSlotError, rejects
from agent.delivery.ledger import JobLedger, JobRecord
from agent.delivery.manifest import DeployManifest, parse_signed, recover_job_id
from agent.delivery.reconcile import Action, decide
from agent.delivery.settings import DeliveryConfig
from agent.delivery.steps import (
    ActivateFn,
    ActivationRequest,
    BuildFn,
    BuildOutcome,
    FetchFn,
    JobReporter,
    ProgressFn,
    SlotSpecsFn,
    no_build,
)
from agent.delivery.verify import verify_model
from agent.errors import AgentError, DeliveryError, EngineError, TransportError
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.postprocess.spec import PostprocessSpec
from agent.protocol.messages import JobEnd, JobState, JobStatus
from agent.protocol.topics import Topics
from agent.signing import Ed25519PublicKey, load_public_key
from agent.store import ModelStore

__all__ = [
    "ActivateFn",
    "ActivationRequest",
    "BuildFn",
    "BuildOutcome",
    "DeliveryService",
    "Deployment",
    "FetchFn",
    "JobReporter",
    "ProgressFn",
    "no_build",
]

log = structlog.get_logger(__name__)

CancelReason = Literal["superseded", "stopping"]
#: Progress is published when it crosses another tenth (bounded spool traffic for any model size).
_PROGRESS_STEPS = 10
#: Ends that are failures (``up/info``'s ``last_failure``); SUPERSEDED is not one: nothing to fix.
_FAILURE_ENDS = frozenset({JobState.FAILED, JobState.REJECTED, JobState.ROLLED_BACK})
#: Longest error message kept in ``up/info`` per end (the job message carries all of it).
_END_ERROR_CHARS = 300
#: Refused payloads remembered per slot, so a retained bad manifest is reported once, not per reconnect.
_REJECTED_MEMORY = 32
_JOIN_SLACK_S = 0.5


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
        store: ModelStore,
        fetch: FetchFn,
        build: BuildFn,
        activate: ActivateFn,
        part_dir: Path,
        max_bytes: int,
        headroom: int,
        preprocess: PreprocessSpec,
        postprocess: PostprocessSpec,
    ) -> None:
        self.manifest = manifest
        self._publish_fn = publish
        self._store = store
        self._fetch = fetch
        self._build = build
        self._activate = activate
        self._part_dir = part_dir
        self._max_bytes = max_bytes
        self._headroom = headroom
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
        self._finished = False
        self._state_lock = threading.Lock()
        self._progress_step = -1

    @property
    def job_id(self) -> str:
        return self.manifest.job_id

    @property
    def requested(self) -> dict[str, Any] | None:
        """The manifest's build request as published (None: no engine build asked)."""
        build = self.manifest.build
        return build.model_dump(mode="json", exclude_none=True) if build is not None else None

    # -- publishing ------------------------------------------------------------------------------

    def _publish(self, state: JobState, **fields: Any) -> None:
        status = JobStatus(
            job_id=self.job_id,
            slot=self.manifest.slot,
            state=state,
            timings_s=dict(self.timings),
            requested=self.requested,
            effective=self.effective,
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
        self._publish_fn(status)

    def _enter(self, state: JobState, **fields: Any) -> None:
        with self._state_lock:
            if self._finished:
                return
            self.state = state
            self._progress_step = -1
        self._publish(state, **fields)

    def queued(self) -> None:
        """Publish QUEUED (called when the service accepts the manifest)."""
        self._publish(JobState.QUEUED, bytes_done=0, bytes_total=self.manifest.size, progress=0.0)

    def finish(self, state: JobState, *, error_code: str | None = None, error: str | None = None) -> bool:
        """Publish the terminal ``state`` once; False if the job had already finished."""
        with self._state_lock:
            if self._finished:
                return False
            self._finished = True
            self.state = state
            self.error_code = error_code
        self._publish(state, error_code=error_code, error=error)
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
        self._publish(JobState.BUILDING, progress=fraction)

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
        self._check_cancel()
        self._timed("download", started)

        started = time.monotonic()
        self._enter(JobState.VERIFYING)
        model = (
            self._store.adopt(fetched, m.sha256) if fetched is not None else self._store.path_for(m.sha256)
        )
        verify_model(
            model, m, max_bytes=self._max_bytes, preprocess=self.preprocess, postprocess=self.postprocess
        )
        self._timed("verify", started)
        self._check_cancel()

        started = time.monotonic()
        self._enter(JobState.BUILDING)
        reporter = JobReporter(
            self._on_build_progress, self.cancel_event, slot=m.slot, preprocess=m.preprocess
        )
        outcome = self._build(model, m.build, reporter)
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
        )
        try:
            self._activate(request)
        except EngineError as exc:
            self._timed("validate", started)
            raise _ActivationFailedError(exc) from exc
        self._timed("validate", started)
        self.finish(JobState.ACTIVE)


class _Lane:
    """One slot's jobs: at most one running and one queued (a newer manifest replaces the queued one)."""

    def __init__(self, slot: str, on_run: Callable[[Deployment], None]) -> None:
        self.slot = slot
        self.cond = threading.Condition()
        self.pending: Deployment | None = None
        self.running: Deployment | None = None
        self.stopping = False
        self._on_run = on_run
        self.thread = threading.Thread(target=self._loop, name=f"delivery-{slot}", daemon=True)
        self.thread.start()

    def in_flight(self) -> list[Deployment]:
        with self.cond:
            return [d for d in (self.running, self.pending) if d is not None]

    def submit(self, job: Deployment) -> Deployment | None:
        """Queue ``job``, cancelling the running one; return the queued job it replaced, if any."""
        with self.cond:
            replaced, self.pending = self.pending, job
            if self.running is not None:
                self.running.cancel("superseded", superseded_by=job.job_id)
            self.cond.notify_all()
        return replaced

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            if self.running is not None:
                self.running.cancel("stopping")
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.pending is None and not self.stopping:
                    self.cond.wait(1.0)
                if self.stopping:
                    return
                job, self.pending = self.pending, None
                self.running = job
            try:
                if job is not None:
                    self._on_run(job)
            finally:
                with self.cond:
                    self.running = None


class DeliveryService:
    """Desired state in, jobs out; commands too. ``start()`` subscribes, ``stop()`` cancels and joins."""

    def __init__(
        self,
        config: DeliveryConfig,
        *,
        device_id: str,
        topics: Topics,
        link: MqttLink,
        store: ModelStore,
        state: JobLedger,
        fetch: FetchFn,
        activate: ActivateFn,
        status: Callable[[], dict[str, Any]],
        rollback: Callable[[str], dict[str, Any]],
        slot_specs: SlotSpecsFn,
        build: BuildFn = no_build,
        protect: Callable[[], set[str]] | None = None,
        part_dir: Path | None = None,
        trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
        on_job_end: Callable[[str], None] | None = None,
    ) -> None:
        """``slot_specs(slot)`` gives a slot's current (preprocess, postprocess), None for an unknown slot.
        ``protect()`` gives model SHA-256s gc must keep (active and last-known-good of every slot);
        by default the models of the jobs recorded in ``state``. ``part_dir`` defaults to
        ``<store.root>/../partial``. ``trusted_keys`` overrides loading ``config.trusted_keys`` files.
        ``on_job_end(slot)`` is called after a job of ``slot`` ended (a refused manifest too), once its
        end is visible in :meth:`job_fields`: the agent republishes ``up/info`` with it.
        """
        self.config = config
        self.device_id = device_id
        self.topics = topics
        self.link = link
        self.store = store
        self.ledger = state
        self._fetch = fetch
        self._build = build
        self._activate = activate
        self._slot_specs = slot_specs
        self._protect = protect
        self.part_dir = part_dir if part_dir is not None else store.root.parent / "partial"
        self.trusted: dict[str, Ed25519PublicKey] = (
            dict(trusted_keys)
            if trusted_keys is not None
            else {key_id: load_public_key(path) for key_id, path in config.trusted_keys.items()}
        )
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._ledger_lock = threading.Lock()
        self._rejected: dict[str, deque[str]] = {}
        # How the last job of each slot ended, and its last failure: in memory (the ledger keeps
        # the last accepted job's state; a refused manifest is refused again after a restart).
        self._ends_lock = threading.Lock()  # its own: ends are published under other locks' holders
        self._ends: dict[str, JobEnd] = {}
        self._failures: dict[str, JobEnd] = {}
        self._on_job_end = on_job_end
        self._started = False
        self._stopped = False
        self.commands = CommandRouter(link, topics)
        self.commands.register("status", lambda _args: {**status(), "delivery": self.describe()})
        self.commands.register("rollback", _rollback_handler(rollback))
        if not config.require_signature:
            log.warning("delivery.signature.not_required", hint="unsigned manifests are accepted; demo only")

    # -- lifecycle -------------------------------------------------------------------------------

    def register_command(self, name: str, handler: CommandHandler) -> None:
        """Add a command (e.g. ``calibrate``) served on ``down/cmd/{name}``."""
        self.commands.register(name, handler)

    def start(self) -> None:
        """Subscribe to desired state and commands. Retained manifests arrive on every (re)subscribe,
        which is what reconciles after each connect."""
        if self._started:
            raise RuntimeError("DeliveryService.start() called twice")
        self._started = True
        self.commands.start()
        self.link.subscribe(self.topics.cmd_filter, self.commands.handle)
        if not self.config.enabled:
            log.info("delivery.disabled")
            return
        self.link.subscribe(self.topics.desired_filter, self.handle_desired)
        log.info(
            "delivery.started",
            trusted_keys=sorted(self.trusted),
            require_signature=self.config.require_signature,
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel running jobs (they resume on the next start) and join the workers within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()) + _JOIN_SLACK_S)
            if lane.thread.is_alive():
                log.warning("delivery.stop.job_still_running", slot=lane.slot)
        self.commands.stop(max(0.1, deadline - time.monotonic()))

    # -- queries ---------------------------------------------------------------------------------

    def last_job(self, slot: str) -> str | None:
        """Id of the last job accepted for ``slot`` (for ``up/info``)."""
        record = self.ledger.last(slot)
        return record.job_id if record is not None else None

    def job_fields(self, slot: str) -> dict[str, Any]:
        """``up/info``'s job fields of ``slot``: last job (a refused one too), its state, last failure."""
        record = self.ledger.last(slot)
        with self._ends_lock:
            end, failure = self._ends.get(slot), self._failures.get(slot)
        fields: dict[str, Any] = {"last_failure": failure}
        refused_later = (
            end is not None
            and end.state is JobState.REJECTED
            and (record is None or end.ts >= record.updated_at)
        )
        if end is not None and (refused_later or (record is not None and end.job_id == record.job_id)):
            # The end of the ledger's job (recorded there a moment later), or a manifest refused after
            # it (never in the ledger). Another job's end (SUPERSEDED by the ledger's) is older news.
            fields.update(last_job=end.job_id, last_job_state=end.state, last_job_error_code=end.error_code)
        elif record is not None:
            fields.update(
                last_job=record.job_id, last_job_state=record.state, last_job_error_code=record.error_code
            )
        if failure is None and record is not None and record.state in _FAILURE_ENDS:
            # After a restart: the ledger still knows how the last job failed (not its message).
            fields["last_failure"] = JobEnd(
                job_id=record.job_id, state=record.state, error_code=record.error_code, ts=record.updated_at
            )
        return fields

    def idle(self) -> bool:
        """True when no job runs or waits (a finished job's bookkeeping and gc are done too)."""
        with self._lock:
            lanes = list(self._lanes.values())
        return not any(lane.in_flight() for lane in lanes)

    def describe(self) -> dict[str, Any]:
        """Per slot: the last recorded job, and the jobs running and queued now."""
        with self._lock:
            lanes = dict(self._lanes)
        slots: dict[str, Any] = {}
        for slot, record in self.ledger.all().items():
            slots[slot] = {"last_job": record.model_dump(mode="json")}
        for slot, lane in lanes.items():
            entry = slots.setdefault(slot, {})
            with lane.cond:
                entry["running"] = lane.running.job_id if lane.running else None
                entry["queued"] = lane.pending.job_id if lane.pending else None
        return {"slots": slots, "require_signature": self.config.require_signature}

    # -- desired state ---------------------------------------------------------------------------

    def handle_desired(self, message: InboundMessage) -> None:
        """Handle one ``down/desired/{slot}`` message (on the dispatcher thread: decide, hand over)."""
        topic_slot = message.topic.rsplit("/", 1)[-1]
        if not message.payload:
            log.info("delivery.desired.cleared", slot=topic_slot)
            return
        digest = hashlib.sha256(message.payload).hexdigest()
        if digest in self._rejected.get(topic_slot, ()):
            return  # the same refused payload again (retained, re-delivered on reconnect)
        try:
            manifest = parse_signed(
                message.payload, self.trusted, self.config.require_signature, self.device_id
            )
            self._check_slot(manifest, topic_slot)
            self._reconcile(manifest, topic_slot, digest)
        except DeliveryError as exc:
            self._refuse(exc, message.payload, topic_slot, digest)

    def _check_slot(self, manifest: DeployManifest, topic_slot: str) -> None:
        if manifest.slot != topic_slot:
            raise WrongSlotError(
                f"manifest is for slot {manifest.slot!r} but arrived on the desired topic of slot "
                f"{topic_slot!r}; publish it on down/desired/{manifest.slot}",
                job_id=manifest.job_id,
            )
        if self._slot_specs(manifest.slot) is None:
            raise WrongSlotError(
                f"this device has no slot {manifest.slot!r}; configure it under slots: first",
                job_id=manifest.job_id,
            )

    def _refuse(self, exc: DeliveryError, payload: bytes, slot: str, digest: str) -> None:
        job_id = getattr(exc, "job_id", None) or recover_job_id(payload)
        log.error("delivery.manifest.rejected", slot=slot, job=job_id, code=exc.code, error=str(exc))
        memory = self._rejected.setdefault(slot, deque(maxlen=_REJECTED_MEMORY))
        memory.append(digest)
        if job_id is None:
            return
        self._publish(
            JobStatus(job_id=job_id, slot=slot, state=JobState.REJECTED, error_code=exc.code, error=str(exc))
        )

    def _reconcile(self, manifest: DeployManifest, slot: str, digest: str) -> None:
        with self._lock:
            if self._stopped:
                return
            lane = self._lanes.get(slot)
            if lane is None:
                lane = self._lanes[slot] = _Lane(slot, self._run_job)
        in_flight = {d.job_id for d in lane.in_flight()}
        decision = decide(manifest, self.ledger.last(slot), in_flight)
        if decision.action is Action.IGNORE:
            log.info("delivery.desired.unchanged", slot=slot, job=manifest.job_id, reason=decision.reason)
            return
        if decision.action is Action.REPLAY:
            raise ReplayError(f"replayed manifest refused: {decision.reason}", job_id=manifest.job_id)
        specs = self._slot_specs(slot)
        assert specs is not None  # checked by _check_slot
        job = Deployment(
            manifest,
            publish=self._publish,
            store=self.store,
            fetch=self._fetch,
            build=self._build,
            activate=self._activate,
            part_dir=self.part_dir,
            max_bytes=self.config.max_model_bytes,
            headroom=self.config.disk_headroom_bytes,
            preprocess=specs[0],
            postprocess=specs[1],
        )
        # Recorded before anything runs: its sequence now bounds replays, and a crash mid-job resumes it.
        with self._ledger_lock:
            self.ledger.record(_record(manifest, JobState.QUEUED))
        job.queued()
        log.info(
            "delivery.job.accepted",
            slot=slot,
            job=manifest.job_id,
            sequence=manifest.sequence,
            reason=decision.reason,
        )
        replaced = lane.submit(job)
        if replaced is not None:
            replaced.finish(
                JobState.SUPERSEDED, error_code="superseded", error=f"superseded by job {manifest.job_id}"
            )

    # -- the worker side -------------------------------------------------------------------------

    def _run_job(self, job: Deployment) -> None:
        state = job.run()
        if state is None:
            return
        with self._ledger_lock:  # a newer job may be recorded concurrently: never overwrite it
            last = self.ledger.last(job.manifest.slot)
            if last is not None and last.job_id == job.job_id:
                self.ledger.record(_record(job.manifest, state, job.error_code))
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        protect = set(self._protect()) if self._protect is not None else set()
        protect.update(record.sha256 for record in self.ledger.all().values())
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            protect.update(d.manifest.sha256 for d in lane.in_flight())
        try:
            self.store.gc(protect, self.config.keep_models)
        except OSError as exc:
            log.error("delivery.gc.failed", error=str(exc))

    def _publish(self, status: JobStatus) -> None:
        try:
            self.link.publish(self.topics.jobs(status.job_id), status, qos=1, durable=True)
        except (TransportError, ValueError) as exc:
            log.error("delivery.job.publish_failed", job=status.job_id, error=str(exc))
        if status.state.terminal:
            self._note_end(status)

    def _note_end(self, status: JobStatus) -> None:
        """Keep how the job ended for ``up/info`` (every end passes ``_publish``) and say so."""
        error = status.error[:_END_ERROR_CHARS] if status.error else None
        end = JobEnd(
            job_id=status.job_id, state=status.state, error_code=status.error_code, error=error, ts=status.ts
        )
        with self._ends_lock:
            self._ends[status.slot] = end
            if status.state in _FAILURE_ENDS:
                self._failures[status.slot] = end
        if self._on_job_end is not None:
            try:
                self._on_job_end(status.slot)
            except Exception as exc:  # noqa: BLE001 - reporting must not fail the job that ended
                log.warning("delivery.job_end.report_failed", slot=status.slot, error=repr(exc))


def _record(manifest: DeployManifest, state: JobState, error_code: str | None = None) -> JobRecord:
    return JobRecord(
        job_id=manifest.job_id,
        slot=manifest.slot,
        sequence=manifest.sequence,
        sha256=manifest.sha256,
        model_id=manifest.model_id,
        version=manifest.version,
        state=state,
        error_code=error_code,
    )


def _rollback_handler(rollback: Callable[[str], dict[str, Any]]) -> CommandHandler:
    def handle(args: dict[str, Any]) -> dict[str, Any]:
        slot = args.get("slot")
        if not isinstance(slot, str) or not slot:
            raise BadArgsError('rollback needs args {"slot": "<slot name>"}')
        return rollback(slot)

    return handle
