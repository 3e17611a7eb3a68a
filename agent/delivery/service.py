"""The delivery service: desired state in, deployment jobs out, commands too.

:class:`DeliveryService` subscribes to ``down/desired/+`` and ``down/cmd/+``, decides per manifest
(:mod:`.reconcile`), and runs one job at a time per slot on that slot's lane (:mod:`.lanes`): the
MQTT dispatcher thread only parses (:mod:`.desired_intake`, which also refuses), decides and hands
over. Job statuses go out through the durable
spool; when a full disk refuses them they are held in memory, in order, until the spool or the link
takes them. A job that failed ``disk_full`` is retried by the upkeep thread once space returns.

One job (manifests in, one job at a time per slot): the reconcile decision, the per-slot lanes and
the disk_full retry share one lock order (reconcile, then the service's lock) that would be easy to
break across modules; the pieces that stand alone have their own modules (the desired-state gate,
deployment, lanes, job records, job ends, the status sender).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, overload

import structlog
from pydantic import BaseModel

from agent.delivery.commands import ArgsT, CommandHandler, CommandRouter, Followed
from agent.delivery.jobs.deployment import Deployment
from agent.delivery.jobs.ends import JobEnds
from agent.delivery.jobs.intake import DesiredIntake
from agent.delivery.jobs.lanes import SlotLane
from agent.delivery.jobs.ledger import JobLedger
from agent.delivery.jobs.reconcile import DISK_FULL, Action, decide
from agent.delivery.jobs.records import JobRecords
from agent.delivery.jobs.status_sender import JobStatusSender
from agent.delivery.jobs.steps import (
    ActivateFn,
    BuildFn,
    FetchFn,
    SlotSpecsFn,
    no_build,
)
from agent.delivery.jobs.targets import DeviceTarget, DeviceTargets
from agent.delivery.settings import DeliveryConfig
from agent.errors import DeliveryError
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.command_args import NoArgs, SlotArgs
from agent.protocol.delivery_errors import DiskFullError, ReplayError
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState, JobStatus
from agent.protocol.topics import Topics, trust_root
from agent.signing import Ed25519PublicKey, load_public_key
from agent.specs.postprocess import RawSpec
from agent.specs.preprocess import PreprocessSpec
from agent.store import ModelStore
from agent.trust.anchor import FleetRoot, adopted_root
from agent.trust.serving import ServingReleases

log = structlog.get_logger(__name__)

#: What a target's job carries as pre/postprocessing: nothing of it is used (no model is loaded).
_TARGET_SPECS = (PreprocessSpec(), RawSpec())

#: Job states that last (an engine build, the candidate beside or in place of the model): up/info is
#: republished as a job enters one, so its last job is the one running, not the one before.
_LONG_PHASES = frozenset({JobState.BUILDING, JobState.SHADOW, JobState.PROBATION})
_JOIN_SLACK_S = 0.5
#: How often held statuses are offered again to the spool or the link.
_HELD_RETRY_S = 0.5
#: Least free space before a disk_full job is retried (a model already stored needs no more).
_RETRY_MIN_FREE = 1024 * 1024


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
        rollback: Callable[[str], dict[str, Any] | Followed],
        slot_specs: SlotSpecsFn,
        build: BuildFn = no_build,
        protect: Callable[[], set[str]] | None = None,
        part_dir: Path | None = None,
        trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
        on_job_end: Callable[[str], None] | None = None,
        on_job_phase: Callable[[str], None] | None = None,
        on_trust_change: Callable[[], None] | None = None,
        targets: DeviceTargets | None = None,
    ) -> None:
        """``slot_specs(slot)`` gives a slot's current (preprocess, postprocess), None for an unknown slot.
        ``protect()`` gives model SHA-256s gc must keep (active and last-known-good of every slot);
        by default the models of the jobs recorded in ``state``. ``part_dir`` defaults to
        ``<store.root>/../partial``. ``trusted_keys`` overrides loading ``config.trusted_keys`` files.
        ``on_job_end(slot)`` is called after a job of ``slot`` ended (a refused manifest too), once its
        end is visible in :meth:`job_fields`: the agent republishes ``up/info`` with it.
        ``on_job_phase(slot)`` likewise when a job of ``slot`` enters BUILDING, SHADOW or PROBATION (a minute
        or more in which the candidate runs or serves): ``up/info`` then shows the running job and
        its phase rather than the previous job.
        ``on_trust_change()`` is called after a new fleet root was taken or adopted: a revoked key may
        flag a serving model (:meth:`release_fields`), so the agent republishes ``up/info``.
        ``targets``: the device's own targets it serves, by name (``_config``, ``_agent``); a manifest
        for one that is not here is refused ``wrong_slot``.
        """
        self.targets: dict[str, DeviceTarget] = dict(targets or {})
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
        self._lanes: dict[str, SlotLane] = {}
        self._lock = threading.Lock()
        self._reconcile_lock = threading.RLock()
        #: Set when the upkeep has work (a held status, an unrecorded end, a disk_full retry) or stops.
        self._upkeep_wake = threading.Event()
        #: The ledger, and terminal records the full disk refused until the upkeep thread writes them.
        self._records = JobRecords(state, on_unrecorded=self._upkeep_wake.set)
        #: Statuses the spool refused (disk full) wait there, in order, until the spool or link takes them.
        self._statuses = JobStatusSender(link, topics, on_held=self._upkeep_wake.set)
        self._ends = JobEnds(on_job_end)
        #: Root versions taken over MQTT (or the root adopted from a trusted key), kept across restarts.
        self._kept_root = store.root.parent / "trust" / "root.json"
        self.fleet_root: FleetRoot | None = None
        if config.trust_root is not None:
            self.fleet_root = FleetRoot(config.trust_root, self._kept_root)
        elif self._kept_root.exists():
            self.fleet_root = FleetRoot(self._kept_root, self._kept_root)
        #: What vouched for each model taken under the root: up/info flags one whose key was revoked.
        self.releases = ServingReleases(self._kept_root.parent / "releases.json")
        self._on_trust_change = on_trust_change
        self._intake = DesiredIntake(
            config,
            device_id=device_id,
            trusted=self.trusted,
            slot_specs=slot_specs,
            records=self._records,
            accept=self._reconcile,
            known=self._job_id_known,
            publish=self._publish,
            fleet_root=self.fleet_root,
            releases=self.releases,
            targets=self.targets,
        )
        self._on_job_phase = on_job_phase
        self._phases: dict[str, tuple[str, JobState]] = {}  # per slot: the phase last announced
        #: Per slot, the manifest (and payload digest) of a job that failed disk_full: retried by itself.
        self._waiting_for_space: dict[str, tuple[DeployManifest, str]] = {}
        self._upkeep_stop = threading.Event()
        self._upkeep: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self.commands = CommandRouter(link, topics)
        self.commands.register("status", lambda _args: {**status(), "delivery": self.describe()}, NoArgs)
        self.commands.register("rollback", lambda args: rollback(args.slot), SlotArgs)
        if not config.require_signature:
            log.warning("delivery.signature.not_required", hint="unsigned manifests are accepted; demo only")

    # -- lifecycle -------------------------------------------------------------------------------

    @overload
    def register_command(
        self,
        name: str,
        handler: Callable[[ArgsT], dict[str, Any]],
        args: type[ArgsT],
        *,
        quiet: bool = False,
    ) -> None: ...
    @overload
    def register_command(
        self, name: str, handler: CommandHandler, args: None = None, *, quiet: bool = False
    ) -> None: ...

    def register_command(
        self,
        name: str,
        handler: Callable[[Any], dict[str, Any] | Followed],
        args: type[BaseModel] | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Add a command (e.g. ``calibrate``) on ``down/cmd/{name}``; ``args``: its arguments' model;
        ``quiet``: a served call is not logged (:meth:`CommandRouter.register`)."""
        self.commands.register(name, handler, args, quiet=quiet)

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
        if self.fleet_root is not None or self.trusted:
            # Before desired states: a retained newer root then arrives first on every (re)subscribe.
            # A device without a root listens too: a root its trusted key vouches for is adopted.
            self.link.subscribe(trust_root(self.topics.prefix), self._take_root)
        self.link.subscribe(self.topics.desired_filter, self.handle_desired)
        log.info(
            "delivery.started",
            fleet_root=self.fleet_root.current().signed.version if self.fleet_root else None,
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
        self._upkeep_wake.set()
        if self._upkeep is not None:
            self._upkeep.join(max(0.1, deadline - time.monotonic()))
        self._statuses.flush()  # last chance: the link is still up, it stops after us
        if self._statuses.held:
            log.error("delivery.job.status_lost", statuses=self._statuses.held, reason="disk full until stop")
        self.commands.stop(max(0.1, deadline - time.monotonic()))

    # -- queries ---------------------------------------------------------------------------------

    def last_job(self, slot: str) -> str | None:
        """Id of the last job accepted for ``slot`` (for ``up/info``)."""
        record = self._records.last(slot)
        return record.job_id if record is not None else None

    def job_fields(self, slot: str) -> dict[str, Any]:
        """``up/info``'s job fields of ``slot``: last job (a refused one too), its state, last failure."""
        return self._ends.fields(slot, self._records.last(slot))

    def release_fields(self, sha256: str | None) -> dict[str, Any]:
        """``up/info``'s ``release_revoked`` of the model ``sha256`` a slot serves: why its release key
        was revoked since it was taken (it keeps serving); nothing on a device without a root."""
        if self.fleet_root is None or sha256 is None:
            return {}
        why = self.releases.revoked(self.fleet_root.current(), sha256)
        return {"release_revoked": why} if why else {}

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
        return self._statuses.held

    def trust_stats(self) -> dict[str, float]:
        """For telemetry (``trust.*``): the fleet root's figures; none on a device without a root."""
        return self.fleet_root.stats() if self.fleet_root is not None else {}

    def _take_root(self, message: InboundMessage) -> None:
        """A ``_trust/root`` chain: take the newer root versions the rules allow, or adopt the root."""
        if self.fleet_root is None:
            adopted = adopted_root(message.payload, self.trusted, self._kept_root)
            if adopted is not None:
                self.fleet_root = self._intake.fleet_root = adopted
                self._intake.forget_refusals()
                self._trust_changed()
            return
        before = self.fleet_root.current()
        self.fleet_root.take(message.payload)
        if self.fleet_root.current() is not before:
            self._intake.forget_refusals()
            self._trust_changed()

    def _trust_changed(self) -> None:
        if self._on_trust_change is None:
            return
        try:
            self._on_trust_change()
        except Exception as exc:  # noqa: BLE001 - reporting must not undo taking the root
            log.warning("delivery.trust_change.report_failed", error=repr(exc))

    # -- desired state ---------------------------------------------------------------------------

    def handle_desired(self, message: InboundMessage) -> None:
        """Handle one ``down/desired/{slot}`` message (on the dispatcher thread: decide, hand over)."""
        self._intake.handle(message)

    def _job_id_known(self, job_id: str) -> bool:
        """True when ``job_id`` has states already: queued or running, a slot's last job, or ended."""
        with self._lock:
            lanes = list(self._lanes.values())
        if any(job_id == d.job_id for lane in lanes for d in lane.in_flight()):
            return True
        if any(record.job_id == job_id for record in self.ledger.all().values()):
            return True
        return self._records.has_ended(job_id)

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
                lane = self._lanes[slot] = SlotLane(slot, self._run_job)
            waiting = self._waiting_for_space.get(slot)
        if not retry and waiting is not None and waiting[0].job_id == manifest.job_id:
            # Failed disk_full and not recorded as such (the ledger could not be written): the same
            # manifest again (a reconnect) waits for space like the recorded case, not a new attempt.
            log.info("delivery.desired.waiting_for_space", slot=slot, job=manifest.job_id)
            return
        in_flight = {d.job_id for d in lane.in_flight()}
        ended = self._records.has_ended(manifest.job_id)
        last = self._records.last(slot)
        decision = decide(manifest, last, in_flight, retry=retry, ended=ended)
        if decision.action is Action.IGNORE:
            log.info("delivery.desired.unchanged", slot=slot, job=manifest.job_id, reason=decision.reason)
            return
        if decision.action is Action.WAIT_FOR_SPACE:
            with self._lock:
                self._waiting_for_space[slot] = (manifest, digest)
            self._upkeep_wake.set()
            log.info("delivery.desired.waiting_for_space", slot=slot, job=manifest.job_id)
            return
        if decision.action is Action.REPLAY:
            raise ReplayError(f"replayed manifest refused: {decision.reason}", job_id=manifest.job_id)
        with self._lock:
            self._waiting_for_space.pop(slot, None)  # this manifest is the slot's attempt now
        if (
            last is not None
            and not last.done
            and last.job_id != manifest.job_id
            and last.job_id not in in_flight
        ):
            # Interrupted by a stop or kill, and its retained manifest replaced while the agent was
            # down: it will never resume, so it ends here, recorded before the newer job's QUEUED.
            self._publish(self._records.end_interrupted(last, by=manifest.job_id))
        target = self.targets.get(slot)
        specs = self._slot_specs(slot) if target is None else _TARGET_SPECS
        assert specs is not None  # checked by the intake
        job = Deployment(
            manifest,
            publish=self._publish,
            record=partial(self._records.record, manifest),
            store=self.store,
            fetch=self._fetch,
            build=self._build,
            activate=self._activate,
            part_dir=self.part_dir,
            max_bytes=self.config.max_model_bytes,
            headroom=self.config.disk_headroom_bytes,
            preprocess=specs[0],
            postprocess=specs[1],
            protect=self._protect or set,
            target=target,
        )
        # Recorded before anything runs: its sequence now bounds replays, and a crash mid-job resumes it.
        try:
            job.queued()
        except DiskFullError as exc:
            log.error("delivery.job.not_recorded", slot=slot, job=manifest.job_id, error=str(exc))
            job.finish(JobState.FAILED, error_code=exc.code, error=str(exc))
            with self._lock:
                self._waiting_for_space[slot] = (manifest, digest)
            self._upkeep_wake.set()
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

    def _run_job(self, job: Deployment) -> None:
        state = job.run()
        if state is None:
            return
        if state is JobState.FAILED and job.error_code == DISK_FULL:
            with self._lock:
                current = self._waiting_for_space.get(job.manifest.slot)
                last = self._records.last(job.manifest.slot)
                # Not when a newer manifest took the slot meanwhile (it is the slot's attempt now).
                newer = last is not None and last.sequence > job.manifest.sequence
                if current is None and not newer:
                    digest = hashlib.sha256(job.manifest.model_dump_json().encode()).hexdigest()
                    self._waiting_for_space[job.manifest.slot] = (job.manifest, digest)
            self._upkeep_wake.set()
        self._collect_garbage()

    # -- upkeep: held statuses, disk_full retries -------------------------------------------------

    def _upkeep_due(self) -> bool:
        """True while the upkeep has something to retry (else it sleeps until woken)."""
        with self._lock:
            waiting = bool(self._waiting_for_space)
        return waiting or self._statuses.held > 0 or self._records.unrecorded() > 0

    def _upkeep_loop(self) -> None:
        next_retry = time.monotonic() + self.config.disk_full_retry_s
        while not self._upkeep_stop.is_set():
            # Every _HELD_RETRY_S while something waits; otherwise asleep until a status is held, an
            # end is not recorded or a job waits for space (each sets _upkeep_wake after the fact,
            # so none is missed). An idle device's upkeep woke twice a second for nothing
            # (bench/fleetsim_idle.py).
            due = self._upkeep_due()
            if not due:
                next_retry = time.monotonic() + self.config.disk_full_retry_s
            self._upkeep_wake.wait(_HELD_RETRY_S if due else None)
            self._upkeep_wake.clear()
            if self._upkeep_stop.is_set():
                return
            try:
                self._statuses.flush()
                self._records.write_unrecorded()
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
                    self._intake.refuse(exc, b"", slot, digest)

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
        """Out through the spool (held in memory when a full disk refuses it); a job end is noted."""
        self._statuses.publish(status)
        if status.state.terminal:
            self._ends.note(status)
        elif status.state in _LONG_PHASES and self._on_job_phase is not None:
            # Once per phase: its figures come as more statuses of the same state.
            phase = (status.job_id, status.state)
            if self._phases.get(status.slot) != phase:
                self._phases[status.slot] = phase
                self._on_job_phase(status.slot)
