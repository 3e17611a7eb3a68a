"""``fleet deploy``: sign a manifest, publish it as every target's desired state, serve the chunks,
and follow each device's job to its end.

The same class drives the CLI, the demo and the end-to-end tests::

    with FleetDeploy(settings, plan, signing_key=key, key_id="fleet-2026") as deploy:
        outcome = deploy.wait(timeout=600)
    if not outcome.ok: ...

What happens (docs/fleet.md): one manifest (one job id, one sequence) is built from the model file;
each device gets a copy naming it in ``device``, signed, published **retained** with QoS 1 on its
``down/desired/{slot}``. A :class:`~agent.fleet.chunks.server.ChunkServer` answers the devices' chunk
requests while the deploy runs. Job states arrive on ``up/jobs/{job_id}``; the deploy is over
when every device reached a terminal state. Messages can be missed (the broker restarted while a
device replayed its spool), so a device that stays quiet is asked with the ``status`` command,
which names its last job and that job's state, and, once it ended, the job's final status message
as the device published it (with its shadow and probation figures); after a reconnect the
manifests are published again, because a broker without persistence forgets retained messages.

A message from a target device that does not parse (its job status, its retained status, its reply
to ``status``) is kept as a note on that device naming the message and the field, and the deploy
goes on: one device's bad message must not end the deploy for the others.

One job (one deploy's lifecycle): publishing, following job states, asking quiet devices and noting
malformed messages all update the same per-device progress under one lock. The plan and its
manifest (:mod:`agent.fleet.deploy.manifest`), what a ``status`` reply says of the job
(:mod:`agent.fleet.deploy.status_reply`), the outcome and the terminal text have their own modules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from agent.errors import ConfigError
from agent.fleet.base.untrusted import shown
from agent.fleet.chunks.server import ChunkServer, random_group
from agent.fleet.deploy.manifest import check_device_ids, plan_manifest
from agent.fleet.deploy.outcome import MAX_MALFORMED_NOTES, DeployOutcome, DeviceProgress
from agent.fleet.deploy.plan import CALIBRATION_ARTIFACT, DeployPlan, new_job_id, next_sequence
from agent.fleet.deploy.status_reply import job_end_of_reply
from agent.fleet.devices.command import PendingReplies, publish_command
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import (
    DeployManifest,
    sign_manifest,
)
from agent.protocol.messages import JobState, JobStatus, ProtocolError, StatusMessage, decode
from agent.protocol.topics import Topics, parse
from agent.signing import Ed25519PrivateKey

log = structlog.get_logger(__name__)

#: A device heard nothing from for this long is asked for its state with the ``status`` command.
DEFAULT_STATUS_POLL_S = 15.0
#: A status query unanswered for this long is given up (asked again at the next poll).
_POLL_REPLY_TIMEOUT_S = 30.0
#: How long start() waits for the targets' retained ``up/status`` before calling a device unknown.
#: A broker sends retained messages right after the SUBACK: milliseconds; this bounds a slow link.
DEFAULT_UNKNOWN_GRACE_S = 2.0


ChangeCallback = Callable[[list[DeviceProgress]], None]


class FleetDeploy:
    """One deployment to one or more devices: ``start()``, then ``poll()``/``wait()``, then ``stop()``."""

    def __init__(
        self,
        settings: MqttSettings,
        plan: DeployPlan,
        *,
        signing_key: Ed25519PrivateKey | None = None,
        key_id: str | None = None,
        serve: bool = True,
        max_rate_bps: float | None = None,
        group: str | None = None,
        on_change: ChangeCallback | None = None,
        status_poll_s: float = DEFAULT_STATUS_POLL_S,
        wait_unknown: bool = True,
        unknown_grace_s: float = DEFAULT_UNKNOWN_GRACE_S,
        manifest: DeployManifest | None = None,
        release: str | None = None,
    ) -> None:
        """``signing_key`` None publishes unsigned manifests (devices must have require_signature off).

        ``release``: the model's signed release (docs/trust.md), sent beside every device's manifest.

        ``manifest``: the unsigned manifest ``plan`` makes, built already (:func:`plan_manifest` with the
        plan's job id and sequence); a rollout passes the one it built for its first wave.

        ``serve`` False leaves the chunks to a ``fleet serve`` (or the HTTP source). ``max_rate_bps``
        caps the chunk bytes served per second (a metered uplink; tests slow transfers with it).
        ``group`` is the chunk server's shared-subscription group (default: one of its own, so every
        request reaches this deploy whatever other servers run). ``on_change`` gets a snapshot of
        every device after each poll that saw a change.

        A device without a retained ``up/status`` when the deploy starts never connected to this
        broker under this prefix (or its id is misspelt): it is marked ``unknown``. With
        ``wait_unknown`` (the class's default) it still gets the retained manifest and the deploy
        waits for it; without (the CLI's default) nothing is published to it and the deploy does
        not wait for it, so a typo ends at once instead of after the whole timeout.
        """
        if not plan.devices:
            raise ConfigError("deploy needs at least one --device")
        if signing_key is not None and not key_id:
            raise ConfigError("a signed deploy needs --key-id: the id devices know the public key by")
        check_device_ids(plan.devices)
        if not Path(plan.model).is_file():
            raise ConfigError(f"model file {plan.model} not found")
        self.settings = settings
        self.plan = plan
        self.prefix = settings.prefix
        self.job_id = plan.job_id or new_job_id(plan.model_id or Path(plan.model).stem, plan.version)
        self.sequence = plan.sequence or next_sequence()
        # A rollout builds its manifest once for all its waves (hashing a large model is not free).
        self.manifest = manifest or plan_manifest(plan, self.job_id, self.sequence)
        #: The manifest each device gets (the same job, naming that device).
        self.manifests: dict[str, DeployManifest] = {
            d: self.manifest.model_copy(update={"device": d}) for d in plan.devices
        }
        #: The exact bytes published on each device's desired topic.
        self.payloads: dict[str, bytes] = {
            d: sign_manifest(m, signing_key, key_id, release) for d, m in self.manifests.items()
        }
        self.signed = signing_key is not None
        self.key_id = key_id if signing_key is not None else None
        self._topics = {d: Topics(self.prefix, d) for d in plan.devices}
        self._devices = {d: DeviceProgress(d, bytes_total=self.manifest.size) for d in plan.devices}
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._on_change = on_change
        self._status_poll_s = status_poll_s
        self._pending = PendingReplies()
        self._polls: dict[bytes, tuple[str, float]] = {}
        self._last_poll = time.monotonic()
        self._max_rate = max_rate_bps
        self._wait_unknown = wait_unknown
        self._unknown_grace_s = unknown_grace_s
        self._client = ServiceClient(settings, handler=self._on_message)
        self._connects = 0
        #: How often the manifests were published again after a reconnect (a rollout counts them).
        self.republished = 0
        self._started = False
        self.server: ChunkServer | None = None
        if serve:
            # Not named after the job id: devices see that, and could join the group (chunks/server.py).
            self.server = ChunkServer(
                settings, group=group or random_group("deploy"), on_served=self._on_served
            )

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> FleetDeploy:
        """Serve the chunks, subscribe to the devices' answers, publish the manifests (retained).

        Raises TransportError when the broker cannot be reached or refuses.
        """
        if self._started:
            raise RuntimeError("FleetDeploy.start() called twice")
        self._started = True
        if self.server is not None:
            # The manifest was just made from this file: no need to hash it again.
            self.server.register(self.manifest, Path(self.plan.model), verify=False)
            if self.plan.calib_cache is not None:
                # Served by SHA-256 like the model: the devices pull it over the same chunk protocol.
                artifact = self.manifest.artifact(CALIBRATION_ARTIFACT)
                self.server.register(self.manifest.for_artifact(artifact), Path(self.plan.calib_cache))
            for name, path in self.plan.wheels:
                # An agent release's wheels, by SHA-256 too: a device pulls only those it lacks.
                wheel = self.manifest.artifact(name)
                self.server.register(self.manifest.for_artifact(wheel), Path(path), verify=False)
            self.server.start(timeout)
        try:
            self._client.start(timeout)
            # Before publishing: QUEUED may follow the manifest within milliseconds.
            self._client.subscribe(f"{self.prefix}/+/up/jobs/{self.job_id}", qos=1, timeout=timeout)
            self._client.subscribe(f"{self.prefix}/+/up/status", qos=1, timeout=timeout)
            self._client.subscribe(f"{self.prefix}/+/up/cmd/status", qos=1, timeout=timeout)
            self._connects = self._client.connects
            self._find_unknown()
            self._publish_manifests()
            self._client.wait_published(timeout)
        except BaseException:
            self.stop()
            raise
        log.info(
            "fleet.deploy.published",
            job=self.job_id,
            sequence=self.sequence,
            devices=[d for d in self.plan.devices if not self._devices[d].skipped],
            sha256=self.manifest.sha256,
            signed=self.signed,
        )
        self._last_poll = time.monotonic()
        return self

    def stop(self) -> None:
        """Stop serving and disconnect. The retained manifests stay: they are the desired state."""
        if self.server is not None:
            self.server.stop()
        self._client.wait_published(2.0)
        self._client.stop()

    def __enter__(self) -> FleetDeploy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- following the jobs ----------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` for news, handle it; True once every device reached a terminal state."""
        changed = self._changed.wait(timeout)
        self._changed.clear()
        if self._client.connects != self._connects and self._client.connected:
            # Reconnected: the broker may have lost the retained manifests and our subscriptions'
            # messages in between; publish again (devices ignore a job they know) and ask.
            self._connects = self._client.connects
            log.warning("fleet.deploy.reconnected", job=self.job_id)
            self._publish_manifests()
            self.republished += 1
            self._ask_status(force=True)
            changed = True
        changed = self._take_status_replies() or changed
        if time.monotonic() - self._last_poll >= self._status_poll_s:
            self._ask_status(force=False)
        if changed and self._on_change is not None:
            self._on_change(self.snapshot())
        return self.finished

    def wait(self, timeout: float | None = None) -> DeployOutcome:
        """Poll until every device reached a terminal state or ``timeout`` seconds passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.outcome()

    @property
    def finished(self) -> bool:
        """True when every device reached a terminal state."""
        with self._lock:
            return all(p.done for p in self._devices.values())

    def snapshot(self) -> list[DeviceProgress]:
        """A copy of every device's progress, in the order the devices were given."""
        with self._lock:
            return [self._devices[d].copy() for d in self.plan.devices]

    def outcome(self) -> DeployOutcome:
        """The deploy's result so far."""
        return DeployOutcome(self.job_id, self.sequence, {p.device: p for p in self.snapshot()})

    # -- MQTT ------------------------------------------------------------------------------------

    def _find_unknown(self) -> None:
        """Mark the targets without a retained ``up/status`` (subscribed already) as unknown."""
        deadline = time.monotonic() + self._unknown_grace_s
        while True:
            with self._lock:
                missing = [p for p in self._devices.values() if p.online is None]
            if not missing or time.monotonic() >= deadline:
                break
            self._changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._changed.clear()
        with self._lock:
            for p in missing:
                p.unknown = True
                p.skipped = not self._wait_unknown
        if missing:
            log.warning(
                "fleet.deploy.unknown_devices",
                devices=[shown(p.device) for p in missing],
                waiting=self._wait_unknown,
                why="no retained up/status: never connected to this broker under this prefix, or misspelt",
            )
        self._changed.set()  # the first poll shows them

    def _publish_manifests(self) -> None:
        for device, payload in self.payloads.items():
            if self._devices[device].skipped:
                continue  # a misspelt id must not keep a retained manifest on the broker forever
            self._client.publish(self._topics[device].desired(self.plan.slot), payload, qos=1, retain=True)

    def _on_message(self, message: InboundMessage) -> None:
        """Dispatcher thread: job states, online status, status-command replies of our devices."""
        try:
            topic = parse(message.topic, self.prefix)
        except ValueError:
            return
        if topic.device not in self._devices:
            return
        try:
            if topic.kind == "jobs" and topic.arg == self.job_id:
                self._apply(topic.device, decode(JobStatus, message.payload))
            elif topic.kind == "status":
                status = decode(StatusMessage, message.payload)
                with self._lock:
                    p = self._devices[topic.device]
                    p.online = status.state == "online"
                    if not p.skipped:
                        p.unknown = False  # heard of now: a device waited for has connected
                self._changed.set()
            elif topic.kind == "cmd":
                self._pending.offer(message)
        except ProtocolError as exc:
            self._note_malformed(topic.device, f"{topic.kind} message: {exc}")

    def _note_malformed(self, device: str, note: str) -> None:
        """Keep ``note`` on ``device``'s progress: a message of it about this deploy did not parse."""
        with self._lock:
            p = self._devices[device]
            p.malformed += 1
            if len(p.malformed_notes) < MAX_MALFORMED_NOTES:
                p.malformed_notes.append(note)
        # The note holds device text; a console log line must not carry its escapes raw.
        log.warning("fleet.deploy.bad_message", device=device, job=self.job_id, error=shown(note, 300))
        self._changed.set()

    def _apply(self, device: str, status: JobStatus) -> None:
        with self._lock:
            if status.msg_id in self._seen:
                return  # a QoS 1 repeat or a spool replay
            self._seen.add(status.msg_id)
            p = self._devices[device]
            if p.done:
                return  # nothing follows a terminal state; a late echo must not undo it
            if not p.history or p.history[-1] is not status.state:
                p.history.append(status.state)
            if p.state is not status.state:
                p.state_since = time.monotonic()
            p.state = status.state
            p.progress = status.progress
            if status.bytes_done is not None:
                p.bytes_done = status.bytes_done
                if status.state is JobState.DOWNLOADING:
                    self._check_rate_cap(p)
            if status.state.terminal and status.state is JobState.ACTIVE:
                p.bytes_done = p.bytes_total
            p.error_code, p.error = status.error_code, status.error
            p.timings_s = dict(status.timings_s)
            p.effective = status.effective or p.effective
            p.shadow = status.shadow or p.shadow
            p.probation = status.probation or p.probation
            p.runs = status.runs or p.runs
            p.build = status.build if status.state is JobState.BUILDING else None
            p.updated = time.monotonic()
        log.info("fleet.deploy.job_state", device=device, job=self.job_id, state=status.state.value)
        self._changed.set()

    def _check_rate_cap(self, p: DeviceProgress) -> None:
        """Notice bytes the device got from elsewhere while ``--max-rate`` is meant to hold (locked).

        Growth of the device's ``bytes_done`` beyond the first non-zero report (what it had on
        resuming, or its first tenth) can only come from chunks someone sent after that report;
        if it exceeds every byte this deploy's server sent, another chunk server (a ``fleet
        serve`` in any group) answered it, and the cap did not hold. One chunk of slack covers a
        chunk counted a moment after the device's report of it.
        """
        if p.bytes_baseline is None:
            if p.bytes_done > 0:
                p.bytes_baseline = p.bytes_done
            return
        if not self._max_rate or self.server is None or self.plan.http_url:
            return  # no cap to hold, or HTTP bytes are expected too
        foreign = p.bytes_done - p.bytes_baseline - p.served - self.manifest.chunk_size
        if foreign > p.foreign_bytes:
            if not p.foreign_bytes:
                log.warning(
                    "fleet.deploy.rate_cap_bypassed",
                    device=shown(p.device),
                    job=self.job_id,
                    why="another chunk server answers this device's requests",
                )
            p.foreign_bytes = foreign

    def _on_served(self, device: str, sha256: str, size: int) -> None:
        """Chunk server thread: count the bytes sent; sleeping here is what throttles the server."""
        if sha256 == self.manifest.sha256 and device in self._devices:
            with self._lock:
                self._devices[device].served += size
            self._changed.set()
        if self._max_rate:
            time.sleep(size / self._max_rate)

    # -- catching up with missed messages --------------------------------------------------------

    def _ask_status(self, *, force: bool) -> None:
        """Send ``status`` to unfinished devices that were quiet for a poll interval (all if ``force``)."""
        now = time.monotonic()
        self._last_poll = now
        asked = {device for device, _ in self._polls.values()}
        with self._lock:
            quiet = [
                p.device
                for p in self._devices.values()
                if not p.done and p.device not in asked and (force or now - p.updated >= self._status_poll_s)
            ]
        for device in quiet:
            correlation = self._pending.expect()
            self._polls[correlation] = (device, now)
            publish_command(self._client, self._topics[device], "status", {}, correlation)

    def _take_status_replies(self) -> bool:
        changed = False
        now = time.monotonic()
        for correlation, (device, sent) in list(self._polls.items()):
            reply = self._pending.take(correlation)
            if reply is None:
                if now - sent > _POLL_REPLY_TIMEOUT_S:
                    self._pending.forget(correlation)
                    del self._polls[correlation]
                continue
            del self._polls[correlation]
            with self._lock:
                self._devices[device].updated = now
            taken = job_end_of_reply(reply, self.plan.slot, self.job_id)
            if isinstance(taken, str):
                self._note_malformed(device, taken)
                changed = True
            elif taken is not None:
                # The job's own message was missed; the device's job ledger says how it ended.
                self._apply(device, taken)
                changed = True
        return changed
