"""Deployment jobs: one manifest through download, verify, build and validate, and the service
that reconciles desired state into jobs.

A :class:`Deployment` goes QUEUED -> DOWNLOADING -> VERIFYING -> BUILDING -> VALIDATING -> ACTIVE,
or ends FAILED / REJECTED / ROLLED_BACK / SUPERSEDED; every transition is first recorded in the job
ledger (``jobs.json``, atomically) and only then published as a
:class:`~agent.protocol.messages.JobStatus` through the durable spool, so a kill at any point can
lose a publication but never make a finished job run again. A ledger write that fails (a full
state disk) ends the job ``FAILED disk_full``; the service retries it when space returns.
:class:`DeliveryService` subscribes to ``down/desired/+`` and ``down/cmd/+``, decides per manifest
(:mod:`.reconcile`), and runs one job at a time per slot on a worker thread of that slot: the MQTT
dispatcher thread only parses, decides and hands over.
"""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import structlog

from agent.camera.preprocess_spec import PreprocessSpec
from agent.delivery.commands import BadArgsError, CommandHandler, CommandRouter
from agent.delivery.errors import (
    DiskFullError,
    JobCancelledError,
    ReplayError,
    TooLargeError,
    WrongSlotError,
    rejects,
)
from agent.delivery.ledger import JobLedger, JobRecord
from agent.delivery.manifest import DeployManifest, parse_signed, recover_job_id
from agent.delivery.reconcile import DISK_FULL, Action, decide
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
from agent.protocol.messages import JobState, JobStatus
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
#: Refused payloads remembered per slot, so a retained bad manifest is reported once, not per reconnect.
_REJECTED_MEMORY = 32
_JOIN_SLACK_S = 0.5
#: A write failing with one of these means the disk is full (a quota counts too).
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Statuses the spool could not take (disk full), held in memory in order; the oldest go first.
_HELD_MAX = 256
#: How often held statuses are offered again to the spool or the link.
_HELD_RETRY_S = 0.5
#: Least free space before a disk_full job is retried (a model already stored needs no more).
_RETRY_MIN_FREE = 1024 * 1024


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
    ) -> None:
        self.manifest = manifest
        self._publish_fn = publish
        self._record_fn = record
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

    def _status(self, state: JobState, **fields: Any) -> JobStatus:
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
        return status

    def _publish(self, state: JobState, **fields: Any) -> None:
        """Publish a progress update within the current state (not recorded: the state is)."""
        self._publish_fn(self._status(state, **fields))

    def _enter(self, state: JobState, **fields: Any) -> None:
        """Record ``state`` in the ledger, then publish it (DiskFullError when it cannot be recorded)."""
        with self._state_lock:
            if self._finished:
                return
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
    ) -> None:
        """``slot_specs(slot)`` gives a slot's current (preprocess, postprocess), None for an unknown slot.
        ``protect()`` gives model SHA-256s gc must keep (active and last-known-good of every slot);
        by default the models of the jobs recorded in ``state``. ``part_dir`` defaults to
        ``<store.root>/../partial``. ``trusted_keys`` overrides loading ``config.trusted_keys`` files.
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
        self._reconcile_lock = threading.RLock()
        #: Per slot, a terminal record the full disk refused; the upkeep thread writes it later.
        self._unrecorded: dict[str, JobRecord] = {}
        self._rejected: dict[str, deque[str]] = {}
        #: Statuses the spool refused (disk full), in publication order, until the spool or link takes them.
        self._held: deque[JobStatus] = deque()
        self._held_lock = threading.Lock()
        #: Per slot, the manifest (and payload digest) of a job that failed disk_full: retried by itself.
        self._waiting_for_space: dict[str, tuple[DeployManifest, str]] = {}
        self._upkeep_stop = threading.Event()
        self._upkeep: threading.Thread | None = None
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
        self._upkeep = threading.Thread(target=self._upkeep_loop, name="delivery-upkeep", daemon=True)
        self._upkeep.start()
        # Publish from the record: a kill between recording a terminal state and spooling it would
        # otherwise leave the operator waiting forever. Same msg_id, so at worst a dropped duplicate.
        for record in self.ledger.all().values():
            if record.done and record.status is not None:
                self._publish(record.status)
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
        self._upkeep_stop.set()
        if self._upkeep is not None:
            self._upkeep.join(max(0.1, deadline - time.monotonic()))
        self._flush_held()  # last chance: the link is still up, it stops after us
        with self._held_lock:
            if self._held:
                log.error("delivery.job.status_lost", statuses=len(self._held), reason="disk full until stop")
        self.commands.stop(max(0.1, deadline - time.monotonic()))

    # -- queries ---------------------------------------------------------------------------------

    def last_job(self, slot: str) -> str | None:
        """Id of the last job accepted for ``slot`` (for ``up/info``)."""
        record = self._last(slot)
        return record.job_id if record is not None else None

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
        with self._lock:
            waiting = {slot: m.job_id for slot, (m, _digest) in self._waiting_for_space.items()}
        return {
            "slots": slots,
            "require_signature": self.config.require_signature,
            "held_statuses": self.held_statuses(),
            "waiting_for_space": waiting,
        }

    def held_statuses(self) -> int:
        """Job statuses waiting in memory because the spool could not store them (a full disk)."""
        with self._held_lock:
            return len(self._held)

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

    def _reconcile(self, manifest: DeployManifest, slot: str, digest: str, *, retry: bool = False) -> None:
        # One decision at a time: the dispatcher (a redelivered manifest) and the upkeep thread (a
        # disk_full retry) could otherwise both apply the same job, and one would supersede the other.
        with self._reconcile_lock:
            self._reconcile_locked(manifest, slot, digest, retry=retry)

    def _reconcile_locked(self, manifest: DeployManifest, slot: str, digest: str, *, retry: bool) -> None:
        with self._lock:
            if self._stopped:
                return
            lane = self._lanes.get(slot)
            if lane is None:
                lane = self._lanes[slot] = _Lane(slot, self._run_job)
            waiting = self._waiting_for_space.get(slot)
        if not retry and waiting is not None and waiting[0].job_id == manifest.job_id:
            # Failed disk_full and not recorded as such (the ledger could not be written): the same
            # manifest again (a reconnect) waits for space like the recorded case, not a new attempt.
            log.info("delivery.desired.waiting_for_space", slot=slot, job=manifest.job_id)
            return
        in_flight = {d.job_id for d in lane.in_flight()}
        decision = decide(manifest, self._last(slot), in_flight, retry=retry)
        if decision.action is Action.IGNORE:
            log.info("delivery.desired.unchanged", slot=slot, job=manifest.job_id, reason=decision.reason)
            return
        if decision.action is Action.WAIT_FOR_SPACE:
            with self._lock:
                self._waiting_for_space[slot] = (manifest, digest)
            log.info("delivery.desired.waiting_for_space", slot=slot, job=manifest.job_id)
            return
        if decision.action is Action.REPLAY:
            raise ReplayError(f"replayed manifest refused: {decision.reason}", job_id=manifest.job_id)
        with self._lock:
            self._waiting_for_space.pop(slot, None)  # this manifest is the slot's attempt now
        specs = self._slot_specs(slot)
        assert specs is not None  # checked by _check_slot
        job = Deployment(
            manifest,
            publish=self._publish,
            record=partial(self._record, manifest),
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
        try:
            job.queued()
        except DiskFullError as exc:
            log.error("delivery.job.not_recorded", slot=slot, job=manifest.job_id, error=str(exc))
            job.finish(JobState.FAILED, error_code=exc.code, error=str(exc))
            with self._lock:
                self._waiting_for_space[slot] = (manifest, digest)
            return
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

    def _record(self, manifest: DeployManifest, status: JobStatus) -> None:
        """Make ``status`` the ledger's record of its job (raises OSError when it cannot be written).

        QUEUED makes the job the slot's last; later states are recorded only while it still is: a
        newer job may have been recorded concurrently, and must never be overwritten.
        """
        record = _record(manifest, status)
        with self._ledger_lock:
            if status.state is not JobState.QUEUED:
                last = self._last_locked(manifest.slot)
                if last is None or last.job_id != manifest.job_id:
                    return
            try:
                self.ledger.record(record)
            except OSError:
                if status.state.terminal:
                    # This process knows the job is over even if the disk does not yet: a redelivered
                    # manifest must not resume it. The upkeep thread writes it once the disk takes it.
                    self._unrecorded[manifest.slot] = record
                raise
            self._unrecorded.pop(manifest.slot, None)

    def _last_locked(self, slot: str) -> JobRecord | None:
        return self._unrecorded.get(slot) or self.ledger.last(slot)

    def _last(self, slot: str) -> JobRecord | None:
        """The slot's last job: the ledger's, or a terminal state the full disk has not taken yet."""
        with self._ledger_lock:
            return self._last_locked(slot)

    def _write_unrecorded(self) -> None:
        with self._ledger_lock:
            for slot, record in list(self._unrecorded.items()):
                try:
                    self.ledger.record(record)
                except OSError:
                    continue
                del self._unrecorded[slot]
                log.info("delivery.job.recorded_late", slot=slot, job=record.job_id, state=record.state.value)

    def _run_job(self, job: Deployment) -> None:
        state = job.run()
        if state is None:
            return
        if state is JobState.FAILED and job.error_code == DISK_FULL:
            with self._lock:
                current = self._waiting_for_space.get(job.manifest.slot)
                last = self._last(job.manifest.slot)
                # Not when a newer manifest took the slot meanwhile (it is the slot's attempt now).
                newer = last is not None and last.sequence > job.manifest.sequence
                if current is None and not newer:
                    digest = hashlib.sha256(job.manifest.model_dump_json().encode()).hexdigest()
                    self._waiting_for_space[job.manifest.slot] = (job.manifest, digest)
        self._collect_garbage()

    # -- upkeep: held statuses, disk_full retries -------------------------------------------------

    def _upkeep_loop(self) -> None:
        next_retry = time.monotonic() + self.config.disk_full_retry_s
        while not self._upkeep_stop.wait(_HELD_RETRY_S):
            try:
                self._flush_held()
                self._write_unrecorded()
                if time.monotonic() >= next_retry:
                    next_retry = time.monotonic() + self.config.disk_full_retry_s
                    self._retry_disk_full()
            except Exception:  # the loop must outlive a surprise: it carries the retries
                log.exception("delivery.upkeep.failed")

    def _retry_disk_full(self) -> None:
        """Run again the jobs that failed disk_full, once space returned and the link is up (their
        download needs it: a retry while offline would only fail on the transfer instead)."""
        if not self.link.connected:
            return
        with self._lock:
            waiting = list(self._waiting_for_space.items())
        for slot, (manifest, digest) in waiting:
            needed = 0 if self.store.has(manifest.sha256) else manifest.size
            try:
                self.store.check_free_space(max(needed, _RETRY_MIN_FREE), self.config.disk_headroom_bytes)
            except (DeliveryError, OSError):
                continue  # still full: try at the next round, publishing nothing meanwhile
            with self._reconcile_lock:  # not interleaved with the same manifest redelivered on connect
                with self._lock:
                    if self._waiting_for_space.get(slot) != (manifest, digest):
                        continue
                    del self._waiting_for_space[slot]
                log.info("delivery.job.retry", slot=slot, job=manifest.job_id, reason="disk space returned")
                try:
                    self._reconcile(manifest, slot, digest, retry=True)
                except DeliveryError as exc:
                    self._refuse(exc, b"", slot, digest)

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
        """Through the spool; when it cannot take the status (disk full), held in memory, in order."""
        with self._held_lock:
            if not self._held and self._send(status, fallback=False):
                return
            if len(self._held) == _HELD_MAX:
                dropped = self._held.popleft()
                log.error("delivery.job.status_dropped", job=dropped.job_id, state=dropped.state.value)
            self._held.append(status)
            log.warning("delivery.job.status_held", job=status.job_id, state=status.state.value)
        self._flush_held()

    def _flush_held(self) -> None:
        """Offer the held statuses, oldest first, to the spool, else (connected) straight to the link."""
        with self._held_lock:
            while self._held and self._send(self._held[0], fallback=True):
                self._held.popleft()

    def _send(self, status: JobStatus, *, fallback: bool) -> bool:
        topic = self.topics.jobs(status.job_id)
        try:
            self.link.publish(topic, status, qos=1, durable=True)
            return True
        except ValueError as exc:  # a bug: never retried
            log.error("delivery.job.publish_failed", job=status.job_id, error=str(exc))
            return True
        except TransportError as exc:
            if not fallback or not self.link.connected:
                log.debug("delivery.job.spool_refused", job=status.job_id, error=str(exc))
                return False
        # The spool is full but the broker is there: QoS 1 from memory (paho resends it until acked
        # while this process lives), rather than the operator never hearing how the job ended.
        try:
            self.link.publish(topic, status, qos=1)
        except TransportError as exc:
            log.error("delivery.job.publish_failed", job=status.job_id, error=str(exc))
        return True


def _record(manifest: DeployManifest, status: JobStatus) -> JobRecord:
    return JobRecord(
        job_id=manifest.job_id,
        slot=manifest.slot,
        sequence=manifest.sequence,
        sha256=manifest.sha256,
        model_id=manifest.model_id,
        version=manifest.version,
        state=status.state,
        error_code=status.error_code,
        status=status,
    )


def _rollback_handler(rollback: Callable[[str], dict[str, Any]]) -> CommandHandler:
    def handle(args: dict[str, Any]) -> dict[str, Any]:
        slot = args.get("slot")
        if not isinstance(slot, str) or not slot:
            raise BadArgsError('rollback needs args {"slot": "<slot name>"}')
        return rollback(slot)

    return handle
