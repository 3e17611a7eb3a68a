"""``edge-agent fleet controller``: the long-running operator process that runs rollouts.

One process (a systemd unit on an operator host) holds:

- the prefix's lease (:mod:`agent.fleet.controller.lease`): taken before anything else, so a second
  controller on the prefix refuses (or, ``standby``, waits) instead of making every rollout twice;
- the rollout state, :class:`~agent.fleet.rollout.store.RolloutStore` in ``{state_dir}/rollouts.sqlite``;
- the model repository ``{state_dir}/models/{sha256}.onnx`` (uploaded by ``fleet rollout start``,
  kept for rollbacks) and a :class:`~agent.fleet.chunks.server.ChunkServer` serving it to devices' pulls
  (it replaces a ``fleet serve`` beside each deploy);
- one :class:`~agent.fleet.rollout.runner.RolloutRunner` per open rollout, stepped by one loop;
- the request/reply API the CLI reaches it by: MQTT 5 requests on ``{prefix}/_controller/req/{verb}``
  with a response topic and correlation data, answered with a
  :class:`~agent.protocol.messages.CommandReply` (docs/protocol.md). Why the broker and not an HTTP
  API (docs/fleet.md): the CLI already reaches the broker with TLS and credentials, the broker's ACL
  decides who may publish requests, and the controller needs no port open to operators.

Requests are queued by the MQTT dispatcher thread and handled by the loop thread, between runner
steps, so the store sees one writer at a time from this process. After a restart (``kill -9``
included) the open rollouts are resumed from the store (see the runner's docstring).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from agent.fleet.base.untrusted import shown
from agent.fleet.chunks.server import ChunkServer
from agent.fleet.controller.calls import ConsoleCalls, LoopCall
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.db_lease import DatabaseLease
from agent.fleet.controller.lease import LeaseLostError, PrefixLease, StandbyEndedError
from agent.fleet.controller.remembered_jobs import jobs_from_store
from agent.fleet.controller.requests import ControllerError, answer_request, json_object
from agent.fleet.controller.start_request import repository_document, stored_rollout
from agent.fleet.controller.upload import UploadSink
from agent.fleet.controller.web import serve_http
from agent.fleet.deploy.decommission import decommission
from agent.fleet.deploy.keys import load_signing_key
from agent.fleet.devices.evidence import evidence_json, fetch_evidence
from agent.fleet.devices.snapshot import snapshot_json, take_snapshot
from agent.fleet.engines.hooks import engine_desk_for, engines_listing, job_facts_in, share_engines_of
from agent.fleet.engines.pg_index import PostgresEngineStore
from agent.fleet.enrollment.desk import EnrollmentDesk
from agent.fleet.enrollment.pg_book import open_enrollment_book
from agent.fleet.metrics.intake_series import IntakeFigures
from agent.fleet.rollout.actions import WrongStateError, action_refusal
from agent.fleet.rollout.finished_rollback import ROLLED_BACK_BY, plan_finished_rollback
from agent.fleet.rollout.pg_store import PostgresRolloutStore
from agent.fleet.rollout.records import OPERATOR_ABORT, RolloutState
from agent.fleet.rollout.report import rollout_status
from agent.fleet.rollout.runner import RolloutRunner
from agent.fleet.rollout.spec import RolloutRequest, request_of
from agent.fleet.rollout.store import RolloutStore, StoreDamagedError, StoreFullError
from agent.fleet.samples.pg_store import open_sample_store
from agent.fleet.samples.store import SampleStore
from agent.fleet.statedb.models import ModelVault
from agent.fleet.statedb.postgres import (
    DatabaseError,
    DatabaseUnavailableError,
    FencedError,
    StateDatabase,
    conninfo_of,
)
from agent.fleet.view.live import FleetView
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.protocol.device_targets import target_kind
from agent.protocol.messages import ProtocolError, decode
from agent.protocol.samples import SampleMessage
from agent.protocol.topics import ControllerTopics, enroll_request_filter, fleet_filter, parse

log = structlog.get_logger(__name__)

#: How often the loop steps the runners when no request arrives.
_TICK_S = 0.2
#: Longest the console's snapshot button waits for the device's reply.
SNAPSHOT_TIMEOUT_S = 10.0
#: Received messages waiting for the dispatcher thread at most (telemetry is shed past half).
INBOX_SIZE = 32_768


def _is_telemetry(message: InboundMessage) -> bool:
    return message.topic.endswith("/up/telemetry")


class FleetController:
    """The controller process's parts (see the module docstring): ``start``, ``run``, ``stop``."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.settings = config.mqtt
        self.topics = ControllerTopics(self.settings.prefix)
        self.store: RolloutStore | None = None
        self.runners: dict[str, RolloutRunner] = {}
        #: Requests from the broker and calls from the console, handled by the loop thread in order.
        self._requests: queue.Queue[InboundMessage | LoopCall] = queue.Queue()
        #: Every device's status, info, telemetry and jobs, for the console and /metrics.
        self.view = FleetView(
            self.settings.prefix,
            stale_after_s=config.stale_after_s,
            max_devices=config.max_devices,
            forget_after_s=config.forget_after_s,
        )
        self.http: Any = None
        self._key = (
            None if config.unsigned or config.signing_key is None else load_signing_key(config.signing_key)
        )
        self._uploads = UploadSink(config.models_dir)
        #: The devices' opt-in samples for retraining, bounded, on disk or in the database (opened in
        #: start()).
        self.samples: SampleStore | None = None
        self.samples_rejected = 0
        #: The store's database (None: SQLite under state_dir); its password read from its file.
        self._conninfo = None if config.database.url is None else conninfo_of(config.database)
        #: One controller per prefix (controller/lease.py, or db_lease.py with PostgreSQL): taken
        #: first thing in start().
        self.lease: PrefixLease | DatabaseLease
        if self._conninfo is None:
            self.lease = PrefixLease(
                self.settings,
                config.state_dir,
                secret=None if self._key is None else self._key.private_bytes_raw(),
                ttl_s=config.lease_ttl_s,
            )
        else:
            self.lease = DatabaseLease(
                StateDatabase(self._conninfo, name="lease"),
                self.settings.prefix,
                config.state_dir,
                ttl_s=config.lease_ttl_s,
            )
        #: The model repository in the database, for a controller that takes over on another host.
        self.vault = (
            None if self._conninfo is None else ModelVault(StateDatabase(self._conninfo, name="models"))
        )
        self._paused = False  # the lease connection dropped: no request, no step until it is back
        self._store_down = False  # the store's database could not be reached: paused likewise
        # A random shared-subscription group of this process's own: a device that knew the group could
        # join it and lose the requests mosquitto hands it (docs/protocol.md, "Broker configuration").
        # One controller holds a prefix, so no other process needs to share it; the client session
        # is clean, so a restarted controller leaves no subscription under the old group behind.
        self.chunks = ChunkServer(self.settings)
        # Telemetry goes first when the dispatcher falls behind: status, info and job states keep
        # half the inbox (a retained burst of a whole fleet at start fits in it).
        self._client = ServiceClient(
            self.settings, handler=self._on_message, inbox_size=INBOX_SIZE, sheddable=_is_telemetry
        )
        #: The second level of the devices' engine caches (agent/fleet/engines/).
        self.engines = engine_desk_for(
            config.engines,
            config.engines_dir,
            prefix=self.settings.prefix,
            key=self._key,
            key_id=config.key_id,
            publish=self._publish_reply,
            job_facts=job_facts_in(self.view),
            sink_for=UploadSink,
            database=None if self._conninfo is None else StateDatabase(self._conninfo, name="engines"),
        )
        #: Devices enrolling with a claim and renewing (agent/fleet/enrollment/); None: off.
        self.enrollment = (
            None
            if config.enrollment.ca_dir is None
            else EnrollmentDesk(
                config.enrollment,
                config.enrollment.ca_dir,
                config.enrollment_path,
                prefix=self.settings.prefix,
                publish=self._publish_enroll_reply,
            )
        )

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0, stop: threading.Event | None = None) -> FleetController:
        """Take the prefix's lease, open the store, serve the repo, listen, resume the open rollouts.

        Raises LeaseHeldError when another controller holds the prefix (unless ``standby``: then
        it waits for the lease, and raises StandbyEndedError if ``stop`` is set meanwhile).
        """
        if not self.lease.acquire(standby=self.config.standby, stop=stop, timeout=timeout):
            raise StandbyEndedError("stopped while standing by")
        try:
            self._start_parts(timeout)
        except BaseException:
            self.lease.release()  # it never ran: another controller may take the prefix at once
            raise
        return self

    def _start_parts(self, timeout: float) -> None:
        self.config.models_dir.mkdir(parents=True, exist_ok=True)
        # First: a damaged or emptied store (StoreDamagedError) stops the start before anything runs.
        if self._conninfo is None:
            self.store = RolloutStore(self.config.store_path)
        else:
            assert isinstance(self.lease, DatabaseLease)
            assert self.vault is not None
            # Every transition checks the lease's token: a holder that lost it writes nothing.
            self.store = PostgresRolloutStore(
                StateDatabase(self._conninfo, name="store"), fence=self.lease.fence
            )
            self.vault.fence = self.lease.fence
            if isinstance(self.engines.store, PostgresEngineStore):
                self.engines.store.fence = self.lease.fence
        self.chunks.add_repo(self.config.models_dir)
        self.engines.start()
        self.chunks.add_repo(self.engines.store.blobs)
        self.chunks.start(timeout)
        self.samples = open_sample_store(
            self.config.samples_dir,
            self.config.samples,
            None if self._conninfo is None else StateDatabase(self._conninfo, name="samples"),
            fence=self.lease.fence if isinstance(self.lease, DatabaseLease) else None,
        )
        if self.enrollment is not None:
            self.enrollment.start(
                open_enrollment_book(
                    self.config.enrollment_path,
                    None if self._conninfo is None else StateDatabase(self._conninfo, name="enrollment"),
                    fence=self.lease.fence if isinstance(self.lease, DatabaseLease) else None,
                )
            )
        self._client.start(timeout)
        if self.enrollment is not None:
            self._client.subscribe(enroll_request_filter(self.settings.prefix), qos=1, timeout=timeout)
            self._client.subscribe(fleet_filter(self.settings.prefix, "cert"), qos=1, timeout=timeout)
        self._client.subscribe(fleet_filter(self.settings.prefix, "samples"), qos=1, timeout=timeout)
        self._client.subscribe(fleet_filter(self.settings.prefix, "engines"), qos=1, timeout=timeout)
        self._client.subscribe(self.topics.request_filter, qos=1, timeout=timeout)
        # Before the devices' retained messages arrive: what the store knows of their last jobs
        # (a restarted controller's console and /metrics show them, with their shadow and probation).
        for device, jobs in jobs_from_store(self.store).items():
            self.view.remember_jobs(device, jobs)
        for topic_filter in self.view.topic_filters():
            self._client.subscribe(topic_filter, qos=1, timeout=timeout)
        for rollout_id in self._unfinished():
            self.runners[rollout_id] = self._runner(rollout_id)
            log.info("fleet.controller.resumed", rollout=rollout_id)
        if self.config.http.port is not None:
            self.http = serve_http(
                self.view,
                self.store,
                ConsoleCalls(self),
                self.config.http,
                engines=lambda: engines_listing(self.engines),
                desk=self.engines,
                enrollment=self.enrollment,
                intake=self.intake,
            )
        log.info(
            "fleet.controller.started",
            state_dir=str(self.config.state_dir),
            resumed=len(self.runners),
            requests=self.topics.request_filter,
        )

    def run(self, stop: threading.Event) -> None:
        """Handle requests and step the rollouts until ``stop`` is set."""
        last_step = 0.0
        message: InboundMessage | LoopCall | None = None
        while not stop.is_set():
            if message is None:
                try:
                    message = self._requests.get(timeout=_TICK_S)
                except queue.Empty:
                    message = None
            if not self._check_lease():
                stop.wait(_TICK_S)  # paused: the request waits (in order) until the lease is back
                continue
            handled, message = message, None
            if isinstance(handled, LoopCall):
                handled.run()
            elif handled is not None:
                self._answer(handled)
            # Steps at least every tick, however many requests arrive: status polls must not starve them.
            if handled is None or time.monotonic() - last_step >= _TICK_S:
                self.step()
                last_step = time.monotonic()

    def _check_lease(self) -> bool:
        """Whether this controller holds the lease and may act (controller/lease.py).

        Its connection dropped (the broker restarted, the network): False, paused, no request
        handled and no step, while the lease tries to get it back. LeaseLostError once it is another
        controller's: that one may drive these rollouts now, so not one more request or step.
        """
        lost = self.lease.lost
        if lost is None and not self._store_down:
            return True
        if not self._paused:
            log.warning(
                "fleet.controller.lease.paused", reason=lost or "the store's database cannot be reached"
            )
            self._paused = True
        try:
            held = self.lease.regain()
        except LeaseLostError as exc:
            log.error("fleet.controller.lease.lost", reason=str(exc))
            raise LeaseLostError(
                f"{exc}; stopping (systemd starts it again: it takes the lease if free)"
            ) from exc
        if held and isinstance(self.lease, DatabaseLease):
            held = self._reload_runners()
        if held:
            log.warning("fleet.controller.lease.resumed")
            self._paused = False
        return held

    def _reload_runners(self) -> bool:
        """After the database was out of reach: the rollouts again from the store, as a restarted
        controller takes them (a transition whose COMMIT was cut may or may not have been kept, so
        what the runners held in memory is not trusted). False while the store cannot be read."""
        try:
            unfinished = self._unfinished()
        except DatabaseUnavailableError:
            return False
        for runner in self.runners.values():
            runner.stop()
        self.runners = {rollout_id: self._runner(rollout_id) for rollout_id in unfinished}
        self._store_down = False
        log.info("fleet.controller.reloaded", rollouts=len(self.runners))
        return True

    def step(self) -> None:
        """Step every open rollout once; forget the ones that are over."""
        for rollout_id, runner in list(self.runners.items()):
            if self.lease.lost is not None:
                return  # not one more rollout step once the lease is gone (the loop pauses or stops)
            try:
                over = runner.step()
            except StoreFullError:
                continue  # the store warned once for the episode; the step is retried at the next tick
            except FencedError as exc:
                # Another controller took the lease while this one could not tell (frozen, cut off).
                fenced = self.store.fenced_writes if isinstance(self.store, PostgresRolloutStore) else 0
                log.error("fleet.controller.lease.fenced", rollout=rollout_id, refused=fenced, error=str(exc))
                raise LeaseLostError(f"{exc}; stopping") from exc
            except DatabaseUnavailableError as exc:
                log.warning("fleet.controller.store_unreachable", rollout=rollout_id, error=str(exc))
                self._store_down = True  # the loop pauses and reloads the rollouts once it is back
                return
            except StoreDamagedError:
                raise  # no rollout can go on from a damaged store: the controller stops, naming the file
            except Exception:  # one rollout's trouble (a broker hiccup) must not stop the others
                log.exception("fleet.controller.step_failed", rollout=rollout_id)
                continue
            if over:
                runner.stop()
                del self.runners[rollout_id]

    def stop(self) -> None:
        """Disconnect everything; the store keeps what a restart needs."""
        if self.http is not None:
            self.http.stop()
        for runner in self.runners.values():
            runner.stop()
        self.engines.stop()
        self._client.stop()
        if self.enrollment is not None:
            self.enrollment.stop()
        self.chunks.stop()
        if self.store is not None:
            self.store.close()
        if self.vault is not None:
            self.vault.database.close()
        if isinstance(self.engines.store, PostgresEngineStore):
            self.engines.store.database.close()
        if self.samples is not None:
            self.samples.close()
        self.lease.release()  # last: nothing of this controller acts once another can take over

    def _unfinished(self) -> list[str]:
        """Open rollouts, and aborted ones whose rollback had not finished."""
        assert self.store is not None
        found = list(self.store.open_rollouts())
        for row in self.store.rollouts(limit=200):
            if row.state is RolloutState.ABORTED and row.rollout_id not in found:
                events = [what for what, _ in self.store.events(row.rollout_id)]
                wants = request_of(row.spec).rollback_on_abort or "abort" in events
                if wants and "rollback_done" not in events:
                    found.append(row.rollout_id)
        return found

    def _runner(self, rollout_id: str) -> RolloutRunner:
        assert self.store is not None
        return RolloutRunner(
            self.store,
            rollout_id,
            settings=self.settings,
            model_path=self.model_path,
            signing_key=self._key,
            key_id=None if self._key is None else self.config.key_id,
            http_url=self.http_url,
            deploy_options={"serve": False, "wait_unknown": True, "status_poll_s": self.config.status_poll_s},
        )

    def intake(self) -> IntakeFigures:
        """What the controller took of the devices' telemetry and what it dropped unread (/metrics)."""
        return IntakeFigures(
            telemetry_taken=self.view.telemetry_taken,
            telemetry_shed=self._client.inbox_shed,
            inbox_full=self._client.inbox_dropped,
        )

    def _publish_reply(self, topic: str, payload: bytes, properties: PublishProperties) -> None:
        self._client.publish(topic, payload, qos=1, properties=properties)

    def _publish_enroll_reply(self, topic: str, payload: bytes) -> None:
        self._client.publish(topic, payload, qos=1)

    def model_path(self, sha256: str) -> Path:
        """The model's file in the repository; with PostgreSQL, fetched from the database first when
        this controller lacks it (it took over from another host, or its state_dir is new)."""
        path = self.config.models_dir / f"{sha256}.onnx"
        if self.vault is not None and not path.is_file():
            self.vault.fetch(sha256, path)
        return path

    def http_url(self, sha256: str) -> str | None:
        base = self.config.http_source
        return None if base is None else f"{base.rstrip('/')}/{sha256}.onnx"

    def _on_message(self, message: InboundMessage) -> None:
        """Dispatcher thread: requests go to the loop, device messages into the view."""
        if self.topics.requested(message.topic) is not None:  # unknown verbs too: they get an answer
            self._requests.put(message)
        elif self.engines.take(message):
            pass  # an engine request: answered on the desk's thread
        elif self.enrollment is not None and self.enrollment.take(message):
            pass  # an enrollment or a renewal: answered on the enrollment desk's thread
        elif message.topic.endswith("/up/samples"):
            self._keep_sample(message)
        else:
            self.view.apply(message)

    def _keep_sample(self, message: InboundMessage) -> None:
        """An ``up/samples`` message into the bounded store; a malformed one is counted and dropped."""
        try:
            device = parse(message.topic, self.settings.prefix).device
            sample = decode(SampleMessage, message.payload)
            if self.samples is not None:
                self.samples.add(device, sample)
        except (ValueError, ProtocolError, OSError) as exc:
            self.samples_rejected += 1
            log.warning(
                "fleet.controller.sample_rejected",
                topic=shown(message.topic, 200),
                error=shown(str(exc), 300),
            )
        except DatabaseError as exc:
            # The sample was fine; the database was out of reach or the lease was taken (the lease
            # and the loop act on those): this one sample is not kept.
            log.warning("fleet.controller.sample_not_kept", topic=shown(message.topic, 200), error=str(exc))

    def call(self, fn: Callable[[], dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
        """Run ``fn`` on the loop thread (as requests are) and return its result or raise its error."""
        call = LoopCall(fn)
        self._requests.put(call)
        return call.result(timeout)

    # -- requests ------------------------------------------------------------------------------------

    def _answer(self, message: InboundMessage) -> None:
        answer_request(message, self.topics, self._handle_on_store, self._client)
        fenced = self.store.fenced_writes if isinstance(self.store, PostgresRolloutStore) else 0
        if fenced:  # the reply said the write was refused; not one more request or step
            log.error("fleet.controller.lease.fenced", refused=fenced)
            raise LeaseLostError(f"{self.lease.lost_for_good or 'the lease token was fenced'}; stopping")

    def _handle_on_store(self, verb: str, message: InboundMessage) -> dict[str, Any]:
        try:
            return self.handle(verb, message)
        except DatabaseUnavailableError:
            # Its transaction may or may not have committed: the loop pauses, then reloads the rollouts.
            self._store_down = True
            raise

    def handle(self, verb: str, message: InboundMessage) -> dict[str, Any]:
        """One request's result (raises ControllerError, ValueError or ValidationError to refuse)."""
        assert self.store is not None
        if verb == "upload":
            taken = self._uploads.take(message.payload, dict(message.user_properties))
            if taken["complete"] and self.vault is not None:
                sha = dict(message.user_properties)["sha256"]
                self.vault.put(sha, self.model_path(sha))  # a controller that takes over finds it there
            return taken
        args: dict[str, Any] = json_object(message.payload)
        if verb == "engines":
            return engines_listing(self.engines)
        if verb == "engines_release":
            return self.engines.release(str(args.get("key", "")), str(args.get("reason", "")))
        if verb.startswith("devices_"):
            return self.devices_request(verb, args)
        if verb == "start":
            return self.start_rollout(RolloutRequest.model_validate(args))
        if verb == "document":
            return repository_document(self.model_path, str(args.get("sha256", "")))
        if verb == "list":
            limit = int(args.get("limit", 50))
            builds = self.view.builds()  # one look at the devices for every rollout listed
            waits = self.engines.claims.waiting(time.monotonic())
            return {
                "rollouts": [
                    rollout_status(self.store, r.rollout_id, builds, waits)
                    for r in self.store.rollouts(limit)
                ]
            }
        rollout_id = args.get("rollout_id")
        if verb == "status":
            if rollout_id is None:
                latest = self.store.rollouts(limit=1)
                if not latest:
                    raise ControllerError("no rollout yet")
                rollout_id = latest[0].rollout_id
            return self.status(str(rollout_id))
        if not isinstance(rollout_id, str):
            raise ControllerError(f"{verb} needs rollout_id")
        if verb == "pause":
            return self.pause(rollout_id)
        if verb == "resume":
            return self.resume(rollout_id)
        if verb == "abort":
            return self.abort(rollout_id, rollback=bool(args.get("rollback", False)))
        if verb == "rollback":
            options = {k: v for k, v in args.items() if k not in ("rollout_id", "new_id")}
            new_id = args.get("new_id")
            return self.roll_back(rollout_id, options, new_id=None if new_id is None else str(new_id))
        raise ControllerError(f"unknown verb {verb}")

    def devices_request(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """``fleet devices register|pending|accept|reject``: the enrollment desk's operator actions."""
        desk = self.enrollment
        if desk is None:
            raise ControllerError(
                "enrollment is off on this controller: set enrollment.ca_dir (docs/enrollment.md)"
            )
        if verb == "devices_pending":
            return desk.pending_list()
        if verb == "devices_enrolled":
            return desk.enrolled_list()
        device = args.get("device_id")
        if verb == "devices_register":
            serial = args.get("serial")
            return desk.register(
                None if device is None else str(device), None if serial is None else str(serial)
            )
        if not isinstance(device, str):
            raise ControllerError(f"{verb} needs device_id")
        if verb == "devices_accept":
            return desk.accept(device, reenroll=bool(args.get("reenroll", False)))
        return desk.reject(device, str(args.get("reason", "")))

    def status(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's status, with its devices building now (their progress: in memory only)."""
        assert self.store is not None
        waits = self.engines.claims.waiting(time.monotonic())  # who waits for whose build
        return rollout_status(self.store, rollout_id, self.view.builds(), waits)

    # -- the actions (the console calls these too) ---------------------------------------------------

    def start_rollout(self, request: RolloutRequest) -> dict[str, Any]:
        """Create and start a rollout; its status. ControllerError when the model is not uploaded."""
        assert self.store is not None
        # Decided once and stored with the rollout: a resumed rollout publishes the same manifests.
        request = share_engines_of(request, self.config.engines, can_sign=self.engines.can_vouch)
        stored = stored_rollout(request, self.model_path, self.settings, self.config.select_wait_s)
        if self.vault is not None:  # a file put in models/ by hand reaches the database too
            for sha in filter(None, (request.model_sha256, request.calib_sha256)):
                self.vault.put(sha, self.model_path(sha))
        self.store.create(stored)
        rollout_id = stored.rollout_id
        self.runners[rollout_id] = self._runner(rollout_id)
        log.info("fleet.controller.rollout_started", rollout=rollout_id, devices=len(request.devices))
        return self.status(rollout_id)

    def decommission(self, device: str, *, force: bool = False) -> dict[str, Any]:
        """Clear ``device``'s retained topics (:mod:`agent.fleet.deploy.decommission`) and forget it here.

        Runs on the caller's thread (the broker round trips touch neither the store nor a runner).
        """
        done = decommission(self.settings, device, force=force)
        self.view.forget(device)  # at once: the cleared status also reaches the view, a moment later
        log.info("fleet.controller.decommissioned", device=device, cleared=len(done.cleared))
        return done.as_dict()

    def snapshot(self, device: str, stream: str | None) -> dict[str, Any]:
        """The device's latest frame of ``stream`` (``snapshot`` command) for the console: what the
        device said about it, and the JPEG as base64 (checked to be one). Runs on the caller's thread."""
        return snapshot_json(take_snapshot(self.settings, device, stream=stream, timeout=SNAPSHOT_TIMEOUT_S))

    def evidence(self, device: str, job_id: str) -> dict[str, Any]:
        """A rejected job's evidence frames (``evidence`` command) for the console, JPEGs as base64."""
        return evidence_json(fetch_evidence(self.settings, device, job_id, timeout=SNAPSHOT_TIMEOUT_S))

    def pause(self, rollout_id: str) -> dict[str, Any]:
        assert self.store is not None
        self._allow("pause", rollout_id)
        self.store.set_state(rollout_id, RolloutState.PAUSED, "paused by the operator")
        return self.status(rollout_id)

    def resume(self, rollout_id: str) -> dict[str, Any]:
        assert self.store is not None
        self._allow("resume", rollout_id)
        self.store.set_state(rollout_id, RolloutState.RUNNING, "resumed by the operator")
        if rollout_id not in self.runners:
            self.runners[rollout_id] = self._runner(rollout_id)
        return self.status(rollout_id)

    def abort(self, rollout_id: str, *, rollback: bool) -> dict[str, Any]:
        assert self.store is not None
        self._allow("abort", rollout_id)
        if rollback:
            self._refuse_target_way_back(rollout_id)
        self.store.note(rollout_id, "abort", rollback=rollback, by="operator")
        self.store.set_state(rollout_id, RolloutState.ABORTED, OPERATOR_ABORT)
        if rollout_id not in self.runners:
            self.runners[rollout_id] = self._runner(rollout_id)
        return self.status(rollout_id)

    def roll_back(
        self, rollout_id: str, options: dict[str, Any], *, new_id: str | None = None
    ) -> dict[str, Any]:
        """Roll back the finished rollout ``rollout_id``: new rollouts, in waves with the gate, take
        its devices back to the model each served before (:mod:`agent.fleet.rollout.finished_rollback`).

        Every new rollout is planned (its model checked, the fleet's up/info read) before the first
        is stored; the finished rollout then notes them, so a second rollback of it is refused."""
        assert self.store is not None
        self._refuse_target_way_back(rollout_id)
        found = plan_finished_rollback(self.store, rollout_id, options, new_id)
        stored = [
            stored_rollout(request, self.model_path, self.settings, self.config.select_wait_s)
            for request in found.requests
        ]
        for plan in stored:
            self.store.create(plan)
            self.runners[plan.rollout_id] = self._runner(plan.rollout_id)
        self.store.note(rollout_id, ROLLED_BACK_BY, **found.note())
        log.info("fleet.controller.rollback_started", rollout=rollout_id, rollouts=found.note()["rollouts"])
        return {
            "rollout_id": rollout_id,
            "rollbacks": [self.status(plan.rollout_id) for plan in stored],
            "no_previous": found.no_previous,
            "unknown_previous": found.unknown_previous,
        }

    def _refuse_target_way_back(self, rollout_id: str) -> None:
        """WrongStateError for a rollback of a device target's rollout: each device puts back its own
        last good configuration or release; the operator rolls the previous one out instead."""
        assert self.store is not None
        slot = self.store.rollout(rollout_id).slot
        if target_kind(slot) != "model":
            raise WrongStateError(
                f"rollout {rollout_id} delivered {slot}: there is no model to go back to; each device "
                f"puts back its own last good one by itself, roll the previous one out to go back"
            )

    def _allow(self, verb: str, rollout_id: str) -> None:
        """RolloutNotFoundError for an unknown id, WrongStateError (the operator's words) for a move
        the rollout's state does not allow; checked on the loop thread, the store's one writer."""
        assert self.store is not None
        refusal = action_refusal(verb, rollout_id, self.store.rollout(rollout_id).state)
        if refusal is not None:
            raise WrongStateError(refusal)


def run_controller(
    config: ControllerConfig, stop: threading.Event, ready: threading.Event | None = None
) -> None:
    """Start, run until ``stop``, stop (the ``fleet controller`` command)."""
    try:
        controller = FleetController(config).start(stop=stop)
    except StandbyEndedError:
        return
    try:
        if ready is not None:
            ready.set()
        print(
            f"controller: state {config.state_dir}, {len(controller.runners)} rollout(s) resumed; "
            f"requests on {controller.topics.request_filter} (pid {os.getpid()})",
            flush=True,
        )
        controller.run(stop)
    finally:
        controller.stop()
