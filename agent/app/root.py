"""Composition root: builds the components, starts them in order, stops them in reverse.

One stop event ends everything. SIGTERM/SIGINT set it; SIGHUP asks for a reload (re-read the
config, hot-swap slots whose model changed). Both are handled on the main thread.

One job (the composition root: build every component, start them in order, stop them in
reverse). Two parts of the wiring have modules of their own: the slots' frame paths
(:mod:`agent.app.frame_paths`) and what the device reports about itself (:mod:`agent.app.device_reports`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from agent import __version__
from agent.app.device_reports import DeviceReports
from agent.app.first_enrollment import enroll_if_needed
from agent.app.frame_paths import FramePaths
from agent.app.health_probe import HealthProbe
from agent.config import AgentConfig, StreamConfig
from agent.config.changes import LIVE_STREAM_KEYS, config_changes, needs_restart
from agent.delivery.jobs.ledger import JobsFile
from agent.delivery.jobs.targets import DeviceTarget
from agent.delivery.service import DeliveryService
from agent.delivery.transfer.pull import fetch_model
from agent.engines.building.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.enrollment.certificate import HeldCertificate, held_certificate
from agent.enrollment.keys import CertificateFacts
from agent.enrollment.renewal import CertificateRenewal
from agent.errors import ConfigError
from agent.lifecycle.bundle.inbox import ImportedStates
from agent.lifecycle.config.document import opener
from agent.lifecycle.config.startup import current_config, starting_config
from agent.lifecycle.config.target import ConfigTarget
from agent.lifecycle.release.target import AgentReleaseTarget
from agent.lifecycle.restart import RESTART_EXIT_CODE
from agent.lifecycle.running import RunningAgent
from agent.logs.ring import LogRing, logs_command
from agent.logs.setup import configure_logging
from agent.machine.platform import detect_platform
from agent.machine.process import shorten_gil_switch
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.command_args import CalibrateArgs, EvidenceArgs, LogsArgs, SnapshotArgs
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET
from agent.protocol.topics import Topics
from agent.runtime.frames.snapshot_command import SnapshotCommand
from agent.runtime.slots.evidence import EvidenceCommand, EvidenceStore
from agent.runtime.slots.models.choice import SlotModels
from agent.runtime.slots.models.fleet_engines import fleet_cache_for
from agent.runtime.slots.slot import ModelSlot, SlotState
from agent.spool.queue import Spool
from agent.state.file import StateFile
from agent.state.lock import StateDirLock
from agent.store import ModelStore
from agent.telemetry import DeviceStats, Metrics, TelemetryLoop
from agent.telemetry.prometheus import TelemetryEndpoint
from agent.watchdog.systemd import Notifier, Watchdog

log = structlog.get_logger(__name__)

#: SIGTERM to exit must stay well inside systemd's TimeoutStopSec (15 s in our unit).
STOP_BUDGET_S = 8.0
#: Time systemd is asked to allow for each slot's first load at start-up.
INITIAL_LOAD_BUDGET_S = 300.0
#: Shortest gap between two ``up/info`` republished because a camera changed state: a camera in a
#: reconnect loop changes state every few seconds, and each info is a retained message.
CAMERA_INFO_GAP_S = 5.0


class Agent:
    """The daemon: every component, wired once."""

    def __init__(
        self, config: AgentConfig, config_path: Path | None = None, log_ring: LogRing | None = None
    ) -> None:
        """``log_ring``: the lines ``configure_logging`` keeps; the ``logs`` command serves them."""
        self.config = config
        self.config_path = config_path
        self.stop_event = threading.Event()
        self.reload_event = threading.Event()
        #: Set by SIGUSR1 (``edge-agent import``): hand the imported desired states in again.
        self.import_event = threading.Event()
        self.imported = ImportedStates(config.state_dir)
        #: What ``edge-agent run`` exits with: RESTART_EXIT_CODE when a configuration or a switched
        #: agent release asks to be started again.
        self.exit_code = 0
        self._reloaded = threading.Condition()
        #: Set at the end of start(): a configuration's probation counts from there.
        self.started = threading.Event()
        self._reloads = 0
        self.metrics = Metrics()
        self.notifier = Notifier.from_env()
        config.state_dir.mkdir(parents=True, exist_ok=True)
        # First, before anything opens a file in it: a second agent on the same state_dir stops here.
        self.state_lock = StateDirLock.acquire(config.state_dir)
        self.topics = Topics(config.mqtt.prefix, config.device_id)
        self.spool = Spool(config.state_dir / "spool.sqlite", config.spool)
        self.link = MqttLink(
            config.mqtt,
            client_id=config.device_id,
            status_topic=self.topics.status,
            agent_version=__version__,
            spool=self.spool,
            on_connected=self._on_connected,
        )
        self.metrics.add_collector(self.link.stats, prefix="mqtt")
        self.metrics.add_collector(self.spool.stats, prefix="spool")
        self.renewal = _renewal(config, self.link, self.topics, self.stop_event, self._on_renewed)
        self.certificate = _certificate_reading(config, self.renewal)
        self.metrics.add_collector(self.certificate.stats, prefix="cert")
        self.platform = detect_platform(config.telemetry.sysfs_root)
        self.frames = FramePaths(config, self.topics, self.link, self.metrics, self.stop_event)
        self.slots = {
            name: ModelSlot(
                name, on_transition=self._slot_changed, parallel_runs=self.frames.layouts[name].workers
            )
            for name in config.slots
        }
        self.store = ModelStore(config.state_dir / "models")
        self.health = HealthProbe(lambda: self.config, self.link, self.frames, self.slots)
        self.config_target = _config_target(
            config,
            config_path,
            RunningAgent(
                config=lambda: self.config,
                restart_keys=self._restart_keys,
                reload=self._reload_now,
                restart=self._restart,
                health=self.health,
                started=self.started,
                changed=self._on_model_activated,
            ),
        )
        self.engines = EngineService(
            EngineBuilder(config.state_dir, config.engines, self.platform),
            config.engines,
            self.frames.tap_frames,
        )
        #: A shadow rejection's disagreement frames, for the ``evidence`` command (bounded, in memory).
        self.evidence = EvidenceStore()
        self.models = SlotModels(
            self.slots,
            config.slots,
            StateFile(config.state_dir / "state.json"),
            self.engines,
            self.metrics,
            latest_frame=self.frames.latest_frame,
            on_activated=self._on_model_activated,
            evidence=self.evidence,
        )
        # The agent's own release (target _agent): a release on trial is watched from start-up.
        self.agent_release = AgentReleaseTarget(
            config.state_dir,
            # Its own probe: a probe's "flowing" compares with its previous reading, so two readers
            # sharing one would see each other's intervals.
            HealthProbe(lambda: self.config, self.link, self.frames, self.slots),
            restart=partial(self._restart, "agent release switched"),
        )
        self.delivery = DeliveryService(
            config.delivery,
            device_id=config.device_id,
            topics=self.topics,
            link=self.link,
            store=self.store,
            state=JobsFile.in_dir(config.state_dir),
            fetch=partial(fetch_model, link=self.link, topics=self.topics, config=config.delivery),
            activate=self.models.activate_delivered,
            status=self._status_report,
            rollback=self.models.rollback,
            slot_specs=self.models.slot_specs,
            build=self.models.build_delivered,
            protect=self.models.protected_models,
            part_dir=config.state_dir / "partial",
            on_job_end=self._on_job_end,
            on_job_phase=self._on_job_end,  # up/info shows the candidate and its phase
            on_trust_change=self._on_model_activated,  # up/info flags a model whose release key was revoked
            targets=self._targets(),
        )
        # The engine cache's second level at the controller (used when a manifest shares engines).
        self.engines.builder.fleet = fleet_cache_for(
            self.link,
            self.topics,
            self.delivery.trusted,
            config.delivery,
            config.state_dir,
            ask_timeout_s=config.engines.fleet_ask_timeout_s,
            wait_max_s=config.engines.fleet_wait_max_s,
        )
        self.delivery.register_command("calibrate", self.models.calibrate, CalibrateArgs)
        reply_limit = partial(self.link.payload_limit, self.topics.cmd_reply("snapshot"))
        snapshot = SnapshotCommand(
            config.snapshot, list(config.streams), self.frames.latest_snapshot, reply_limit
        )
        self.delivery.register_command("snapshot", snapshot, SnapshotArgs)
        evidence_limit = partial(self.link.payload_limit, self.topics.cmd_reply("evidence"))
        evidence = EvidenceCommand(self.evidence, evidence_limit)
        self.delivery.register_command("evidence", evidence, EvidenceArgs)
        if log_ring is not None:
            logs_limit = partial(self.link.payload_limit, self.topics.cmd_reply("logs"))
            self.delivery.register_command("logs", logs_command(log_ring, logs_limit), LogsArgs, quiet=True)
        self.metrics.add_collector(self.delivery.commands.stats, prefix="commands")
        self.telemetry: TelemetryLoop | None = None
        self.watchdog: Watchdog | None = None
        prometheus = config.telemetry.prometheus
        # Opt-in: serves the figures of each telemetry message; figures older than three intervals
        # are left out (the loop stopped), as Prometheus expects of a silent source.
        self.metrics_endpoint = (
            TelemetryEndpoint(prometheus.host, prometheus.port, stale_after_s=3 * config.telemetry.interval_s)
            if prometheus.port is not None
            else None
        )
        self.reports = DeviceReports(
            lambda: self.config,
            platform=self.platform,
            slots=self.slots,
            models=self.models,
            delivery=self.delivery,
            frames=self.frames,
            link=self.link,
            topics=self.topics,
            metrics=self.metrics,
            metrics_endpoint=self.metrics_endpoint,
            certificate=self.certificate.info,
            # Reported once the agent runs as a release (installed by the launcher), absent before.
            agent_release=self.agent_release.info if self.agent_release.running else lambda: None,
            config_overlay=self.config_target.info if self.config_target is not None else lambda: None,
        )

    def _targets(self) -> dict[str, DeviceTarget]:
        """The device's own targets the job runner serves: its agent release, and its configuration
        overlay when agent.yaml is a file it can lay one over."""
        targets: dict[str, DeviceTarget] = {AGENT_TARGET: self.agent_release}
        if self.config_target is not None:
            targets[CONFIG_TARGET] = self.config_target
        return targets

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        shorten_gil_switch()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()  # first: a taken port fails the start before anything runs
        self.delivery.start()  # subscribes before connecting: retained manifests arrive on connect
        self.hand_in_imported()  # dispatched first, as retained ones would be; needs no broker
        if self.renewal is not None:
            self.renewal.start()  # subscribes to down/cert before connecting too
        self.link.start()
        for name, slot_config in self.config.slots.items():
            # Loading (and later, building) an engine can outlast systemd's start timeout.
            self.notifier.extend_timeout(INITIAL_LOAD_BUDGET_S)
            self.models.load_initial(name, slot_config)
        self.frames.build(self.slots)
        self.metrics.add_collector(self.reports.slot_stats, prefix="slot")
        self.metrics.add_collector(self.delivery.trust_stats, prefix="trust")
        self.frames.start_samples()
        self.frames.start()
        self.models.start_deferred_builds()
        self.telemetry = TelemetryLoop(
            self.metrics,
            DeviceStats(self.config.telemetry.sysfs_root),
            self.reports.publish_telemetry,
            self.config.telemetry.interval_s,
            self.stop_event,
        )
        self.telemetry.start()
        self.watchdog = Watchdog(self.notifier, self.stop_event)
        self.watchdog.add_check("frame_loop", lambda: self.frames.alive(self.config.watchdog.stuck_call_s))
        self.watchdog.add_check("mqtt_link", self.link.healthy)
        self.notifier.ready(status=self.reports.status_line())
        self.watchdog.start()  # after READY=1: systemd counts watchdog pings from then on
        self.agent_release.start()  # a release on trial: confirmed after its health window, or put back
        self.started.set()
        empty = [name for name, slot in self.slots.items() if slot.current is None]
        log.info(
            "agent.started",
            device=self.config.device_id,
            slots=list(self.slots),
            empty_slots=empty,
            version=__version__,
        )

    # -- run ---------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def on_stop(signum: int, _frame: FrameType | None) -> None:
            log.info("agent.signal", signal=signal.Signals(signum).name)
            self.stop_event.set()

        def on_reload(_signum: int, _frame: FrameType | None) -> None:
            self.reload_event.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_reload)
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: self.import_event.set())

    def run_forever(self) -> None:
        """Serve until the stop event; reloads run here, on the main thread."""
        camera_info_at = 0.0
        while not self.stop_event.wait(0.2):
            if self.reload_event.is_set():
                self.reload_event.clear()
                self.reload()
            if self.import_event.is_set():
                self.import_event.clear()
                self.hand_in_imported()
            cameras = self.frames.cameras_changed
            if cameras.is_set() and time.monotonic() - camera_info_at >= CAMERA_INFO_GAP_S:
                cameras.clear()
                camera_info_at = time.monotonic()
                if self.link.connected:
                    self.reports.publish_info()

    def hand_in_imported(self) -> None:
        """The desired states ``edge-agent import`` kept, dispatched as if the broker had sent them
        retained: the same intake checks them and the job runner ignores a job id it ran already."""
        for kept in self.imported.messages(self.topics):
            taken = self.link.hand_in(InboundMessage(kept.topic, kept.payload, qos=1, retain=True))
            log.info("bundle.handed_in", topic=kept.topic, taken=taken)

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the config; hot-swap every slot whose model changed. A bad config changes nothing."""
        try:
            self._reload()
        finally:
            with self._reloaded:
                self._reloads += 1
                self._reloaded.notify_all()

    def _reload(self) -> None:
        if self.config_path is None:
            return
        self.notifier.reloading()
        try:
            new = current_config(self.config_path)
        except ConfigError as exc:
            log.error("config.reload.invalid", problems=exc.problems)
            self.notifier.ready(status="reload refused: invalid config; still serving the previous one")
            return
        changes = config_changes(self.config, new)
        running_streams = set(self.frames.cameras())
        later = self._restart_keys(new)
        if later:
            log.warning("config.reload.restart_required", keys=later, reason="these take effect at restart")
        swapping = self.models.reload(new.slots)
        retuned = self.frames.retune({n: s for n, s in new.streams.items() if n in running_streams})
        log.info(
            "config.reload.applied",
            changed={c.key: c.shown() for c in changes},
            swapping=swapping,
            retuned=retuned,
            restart_required=later,
        )
        # What runs now: the slots that exist (with their new settings), the running streams' tuning
        # and the watchdog's bound; every other key waits for a restart, so the next reload reports it
        # again instead of forgetting it.
        slots = {name: new.slots.get(name, self.config.slots[name]) for name in self.slots}
        streams = {
            name: _tuned(stream, new.streams.get(name)) for name, stream in self.config.streams.items()
        }
        self.config = self.config.model_copy(
            update={"slots": slots, "streams": streams, "watchdog": new.watchdog}
        )
        self.notifier.ready(status=self.reports.status_line())

    def _restart_keys(self, new: AgentConfig) -> list[str]:
        """The keys of ``new`` that a reload does not apply (they wait for a restart)."""
        running_streams = set(self.frames.cameras())
        changes = config_changes(self.config, new)
        return [c.key for c in changes if needs_restart(c, set(self.slots), running_streams)]

    def _reload_now(self) -> None:
        """A reload on the main thread, as SIGHUP asks for one; returns once it ran (or the agent stops)."""
        with self._reloaded:
            done = self._reloads
            self.reload_event.set()
            while self._reloads == done and not self.stop_event.is_set():
                self._reloaded.wait(0.5)

    def _restart(self, reason: str = "configuration") -> None:
        """Stop in order and exit with RESTART_EXIT_CODE: systemd starts the agent (the launcher) again."""
        log.info("agent.restart", reason=reason, exit_code=RESTART_EXIT_CODE)
        self.exit_code = RESTART_EXIT_CODE
        self.stop_event.set()

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ordered stop: frames, inference drain, telemetry, swaps, link (flush + offline), slots."""
        deadline = time.monotonic() + STOP_BUDGET_S
        self.stop_event.set()
        self.notifier.stopping()
        self.agent_release.stop()
        self.frames.stop(deadline - 2.5)
        if self.telemetry is not None:
            self.telemetry.join(max(0.1, deadline - 2.5 - time.monotonic()))
        if self.frames.samples is not None:
            self.frames.samples.join(max(0.1, deadline - 2.5 - time.monotonic()))
        if self.watchdog is not None:
            self.watchdog.join(1.0)
        if self.renewal is not None:
            self.renewal.join(1.0)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        self.models.join_swaps(deadline - 2.5 - time.monotonic())
        self.delivery.stop(timeout=max(0.1, deadline - 2.0 - time.monotonic()))
        self.link.stop(timeout=max(0.5, deadline - time.monotonic()))
        for slot in self.slots.values():
            slot.close()
        self.spool.close()
        self.state_lock.release()
        log.info("agent.stopped")

    # -- reporting ---------------------------------------------------------------------------

    def _status_report(self) -> dict[str, Any]:
        # The delivery service is wired before the reports exist (they read its jobs): asked later.
        return self.reports.status_report()

    def _on_model_activated(self) -> None:
        if self.link.connected:
            self.reports.publish_info()

    def _on_job_end(self, _slot: str) -> None:
        # up/info is retained: `fleet status` shows each slot's last job and last failure from it.
        if self.link.connected:
            self.reports.publish_info()

    def _on_renewed(self, _facts: CertificateFacts) -> None:
        if self.link.connected:
            self.reports.publish_info()

    def _on_connected(self, session: int) -> None:
        log.info("agent.connected", session=session)
        self.reports.publish_info()

    def _slot_changed(self, name: str, _old: SlotState, new: SlotState) -> None:
        self.metrics.counter(f"slot.{name}.transitions.{new.value}").inc()


def _tuned(running: StreamConfig, new: StreamConfig | None) -> StreamConfig:
    """``running`` with ``new``'s live keys (LIVE_STREAM_KEYS), when the stream is still configured."""
    if new is None:
        return running
    return running.model_copy(update={key: getattr(new, key) for key in LIVE_STREAM_KEYS})


def _renewal(
    config: AgentConfig,
    link: MqttLink,
    topics: Topics,
    stop: threading.Event,
    on_renewed: Callable[[CertificateFacts], None],
) -> CertificateRenewal | None:
    """Renewal over the device's own connection, for a device enrolled by claim (renewal on)."""
    enrollment, tls = config.enrollment, config.mqtt.tls
    if enrollment is None or not enrollment.renewal.enabled or tls is None:
        return None
    if tls.cert_file is None or tls.key_file is None:
        return None
    return CertificateRenewal(
        config.device_id,
        enrollment.renewal,
        cert_file=tls.cert_file,
        key_file=tls.key_file,
        link=link,
        topics=topics,
        stop=stop,
        on_renewed=on_renewed,
    )


def _certificate_reading(config: AgentConfig, renewal: CertificateRenewal | None) -> HeldCertificate:
    """What up/info and telemetry say of the certificate: the renewal's latest, else the file's."""
    if renewal is not None:
        return HeldCertificate(lambda: renewal.certificate, renewal.stats)
    tls = config.mqtt.tls
    facts = held_certificate(tls.cert_file) if tls is not None and tls.cert_file is not None else None
    return HeldCertificate(lambda: facts)


def _config_target(
    config: AgentConfig, config_path: Path | None, running: RunningAgent
) -> ConfigTarget | None:
    """The ``_config`` target of an agent started from a file (an overlay is merged over it)."""
    if config_path is None:
        return None
    tls = config.mqtt.tls
    return ConfigTarget(
        config_path,
        config.state_dir,
        opener(tls.key_file if tls is not None else None, config.device_id),
        running,
    )


def run(config_path: Path) -> int:
    """``edge-agent run``: start, serve until SIGTERM, stop in order. Returns the exit code: 0, or
    RESTART_EXIT_CODE when a configuration overlay needs the agent started again."""
    config = starting_config(config_path)
    ring = LogRing(config.logging.ring_lines, config.logging.ring_bytes)
    configure_logging(config.logging.format, config.logging.level, ring=ring)
    if not enroll_if_needed(config, Notifier.from_env()):
        return 0
    # Ignored until the handler is in place: `edge-agent import` may signal as soon as the state
    # directory is locked, and the default action would end the agent. start() reads the kept states.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    agent = Agent(config, config_path, ring)
    agent.install_signal_handlers()
    try:
        agent.start()
        agent.run_forever()
    finally:
        agent.stop()
    return agent.exit_code
