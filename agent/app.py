"""Composition root: builds the components, starts them in order, stops them in reverse.

One stop event ends everything. SIGTERM/SIGINT set it; SIGHUP asks for a reload (re-read the
config, hot-swap slots whose model changed). Both are handled on the main thread.

One job (the composition root: build every component, start them in order, stop them in
reverse), a little over 400 lines because every component is wired here and nowhere else.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import TypeAdapter

from agent import __version__
from agent.camera.gst_pipelines import scaled_for
from agent.camera.source import VideoSource
from agent.config import AgentConfig, load_config
from agent.config.changes import config_changes, needs_restart
from agent.cpus import usable_cpus
from agent.delivery.ledger import JobsFile
from agent.delivery.service import DeliveryService
from agent.delivery.transfer import fetch_model
from agent.engines.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.errors import ConfigError
from agent.log_ring import LogRing, logs_command
from agent.logs import configure_logging
from agent.mqtt.link import MqttLink
from agent.platform import detect_platform, platform_summary
from agent.postprocess.spec import PostprocessSpec
from agent.protocol.command_args import CalibrateArgs, EvidenceArgs, LogsArgs, SnapshotArgs
from agent.protocol.messages import (
    BackendInfo,
    EngineInfo,
    InfoMessage,
    SlotBuildInfo,
    SlotInfo,
    TelemetryMessage,
)
from agent.protocol.topics import Topics
from agent.runtime.evidence import EvidenceCommand, EvidenceStore
from agent.runtime.fleet_engines import fleet_cache_for
from agent.runtime.layout import Layout, slot_layout
from agent.runtime.models import SlotModels
from agent.runtime.pipeline import SlotPipeline
from agent.runtime.samples import SamplePublisher, Sampler
from agent.runtime.slot import ModelSlot, SlotState
from agent.runtime.snapshot_command import SnapshotCommand
from agent.runtime.snapshots import Snapshot
from agent.runtime.stage_items import StreamPlan
from agent.spool import Spool
from agent.state import StateFile
from agent.state_lock import StateDirLock
from agent.store import ModelStore
from agent.systemd import Notifier, Watchdog
from agent.telemetry import DeviceStats, Metrics, TelemetryLoop
from agent.telemetry.prometheus import TelemetryEndpoint

log = structlog.get_logger(__name__)

Origin = Literal["config", "delivery", "rollback"]
_POSTPROCESS: TypeAdapter[PostprocessSpec] = TypeAdapter(PostprocessSpec)

#: SIGTERM to exit must stay well inside systemd's TimeoutStopSec (15 s in our unit).
STOP_BUDGET_S = 8.0
#: Time systemd is asked to allow for each slot's first load at start-up.
INITIAL_LOAD_BUDGET_S = 300.0
#: How long calibration or the INT8 guard waits for live frames.
FRAME_TAP_TIMEOUT_S = 60.0
#: A frame path that has not turned over in this long is reported dead to the watchdog.
HEARTBEAT_STALE_S = 10.0
#: How long a Python thread may keep the GIL while another waits for it (CPython's default: 5 ms).
#: The frame path's threads spend most of their time in C (decode, inference) and need the GIL back
#: for a few microseconds after each call; behind a publisher running Python they could wait up to
#: the full interval. 1 ms: +4 % frames and -5 % CPU per frame on the tiny-model bench (medians of 5
#: interleaved runs), no change on the heavy one.
GIL_SWITCH_INTERVAL_S = 0.001


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
        self.platform = detect_platform(config.telemetry.sysfs_root)
        self.layouts: dict[str, Layout] = {name: self._layout(name) for name in config.slots}
        self.slots = {
            name: ModelSlot(name, on_transition=self._slot_changed, parallel_runs=self.layouts[name].workers)
            for name in config.slots
        }
        self.store = ModelStore(config.state_dir / "models")
        self.engines = EngineService(
            EngineBuilder(config.state_dir, config.engines, self.platform), config.engines, self._tap_frames
        )
        #: A shadow rejection's disagreement frames, for the ``evidence`` command (bounded, in memory).
        self.evidence = EvidenceStore()
        self.models = SlotModels(
            self.slots,
            config.slots,
            StateFile(config.state_dir / "state.json"),
            self.engines,
            self.metrics,
            latest_frame=self._latest_frame,
            on_activated=self._on_model_activated,
            evidence=self.evidence,
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
            status=self.status_report,
            rollback=self.models.rollback,
            slot_specs=self.models.slot_specs,
            build=self.models.build_delivered,
            protect=self.models.protected_models,
            part_dir=config.state_dir / "partial",
            on_job_end=self._on_job_end,
            on_job_phase=self._on_job_end,  # up/info shows the candidate and its phase (issue 22.10)
        )
        # The engine cache's second level at the controller (used when a manifest shares engines).
        self.engines.builder.fleet = fleet_cache_for(
            self.link,
            self.topics,
            self.delivery.trusted,
            config.delivery,
            config.state_dir,
            ask_timeout_s=config.engines.fleet_ask_timeout_s,
        )
        self.delivery.register_command("calibrate", self.models.calibrate, CalibrateArgs)
        reply_limit = partial(self.link.payload_limit, self.topics.cmd_reply("snapshot"))
        snapshot = SnapshotCommand(config.snapshot, list(config.streams), self._latest_snapshot, reply_limit)
        self.delivery.register_command("snapshot", snapshot, SnapshotArgs)
        evidence_limit = partial(self.link.payload_limit, self.topics.cmd_reply("evidence"))
        evidence = EvidenceCommand(self.evidence, evidence_limit)
        self.delivery.register_command("evidence", evidence, EvidenceArgs)
        if log_ring is not None:
            logs_limit = partial(self.link.payload_limit, self.topics.cmd_reply("logs"))
            self.delivery.register_command("logs", logs_command(log_ring, logs_limit), LogsArgs)
        self.metrics.add_collector(self.delivery.commands.stats, prefix="commands")
        self.pipelines: list[SlotPipeline] = []
        # Set once the pipelines exist: a deployment whose manifest arrives (retained) while the
        # first models load must wait for them before it can tap live frames for calibration.
        self._pipelines_built = threading.Event()
        self.telemetry: TelemetryLoop | None = None
        self.watchdog: Watchdog | None = None
        #: Publishes the opt-in samples for retraining (None: no slot samples).
        self.samples: SamplePublisher | None = None
        prometheus = config.telemetry.prometheus
        # Opt-in: serves the figures of each telemetry message; figures older than three intervals
        # are left out (the loop stopped), as Prometheus expects of a silent source.
        self.metrics_endpoint = (
            TelemetryEndpoint(prometheus.host, prometheus.port, stale_after_s=3 * config.telemetry.interval_s)
            if prometheus.port is not None
            else None
        )

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()  # first: a taken port fails the start before anything runs
        self.delivery.start()  # subscribes before connecting: retained manifests arrive on connect
        self.link.start()
        for name, slot_config in self.config.slots.items():
            # Loading (and later, building) an engine can outlast systemd's start timeout.
            self.notifier.extend_timeout(INITIAL_LOAD_BUDGET_S)
            self.models.load_initial(name, slot_config)
        self.pipelines = self._build_pipelines()
        self._pipelines_built.set()
        self.samples = self._start_samples()
        for pipeline in self.pipelines:
            pipeline.start()
        self.models.start_deferred_builds()
        self.telemetry = TelemetryLoop(
            self.metrics,
            DeviceStats(self.config.telemetry.sysfs_root),
            self._publish_telemetry,
            self.config.telemetry.interval_s,
            self.stop_event,
        )
        self.telemetry.start()
        self.watchdog = Watchdog(self.notifier, self.stop_event)
        self.watchdog.add_check("frame_loop", self._frame_loop_alive)
        self.watchdog.add_check("mqtt_link", self.link.healthy)
        self.notifier.ready(status=self._status_line())
        self.watchdog.start()  # after READY=1: systemd counts watchdog pings from then on
        empty = [name for name, slot in self.slots.items() if slot.current is None]
        log.info(
            "agent.started",
            device=self.config.device_id,
            slots=list(self.slots),
            empty_slots=empty,
            version=__version__,
        )

    def _start_samples(self) -> SamplePublisher | None:
        """Opt-in per slot: a sampler on each sampling slot's frame board, one thread publishing."""
        samplers = []
        for pipeline in self.pipelines:
            config = self.config.slots[pipeline.slot.name].samples
            if config.enabled:
                sampler = Sampler(config, pipeline.slot.name)
                pipeline.snapshots.on_paired = sampler.offer
                samplers.append(sampler)
        if not samplers:
            return None
        publisher = SamplePublisher(
            samplers,
            lambda message: self.link.publish(self.topics.samples, message, qos=1),
            partial(self.link.payload_limit, self.topics.samples),
            self.stop_event,
        )
        self.metrics.add_collector(publisher.stats, prefix="samples")
        publisher.start()
        return publisher

    def _pipeline(self, slot: str) -> SlotPipeline | None:
        return next((p for p in self.pipelines if p.slot.name == slot), None)

    def _latest_frame(self, slot: str) -> npt.NDArray[np.uint8] | None:
        pipeline = self._pipeline(slot)
        return pipeline.last_image if pipeline else None

    def _latest_snapshot(self, stream: str) -> Snapshot | None:
        for pipeline in self.pipelines:
            if any(plan.name == stream for plan in pipeline.streams):
                return pipeline.snapshots.latest(stream)
        return None

    def _layout(self, slot: str, model_ms: float | None = None, engines: int | None = None) -> Layout:
        streams = [s for s in self.config.streams.values() if s.slot == slot]
        return slot_layout(self.config.slots[slot], streams, usable_cpus(), model_ms, engines)

    def _build_pipelines(self) -> list[SlotPipeline]:
        pipelines = []
        for slot_name, slot in self.slots.items():
            plans = []
            for stream_name, stream in self.config.streams.items():
                if stream.slot != slot_name:
                    continue
                # A camera pipeline scales frames to this slot's input before they reach the CPU.
                model = slot.current
                preprocess = model.preprocess if model else self.config.slots[slot_name].preprocess
                source = VideoSource(stream_name, scaled_for(stream.source, preprocess))
                policy = stream.drop_policy
                if policy == "auto":
                    policy = "keep_newest" if source.is_live else "process_all"
                plans.append(
                    StreamPlan(
                        name=stream_name,
                        source=source,
                        slot=slot_name,
                        topic=self.topics.results(stream_name),
                        policy=policy,
                        queue_size=stream.queue_size,
                        fps_limit=stream.fps_limit,
                        qos=1 if stream.durable_results else stream.results_qos,
                        durable=stream.durable_results,
                    )
                )
                self.metrics.rate(f"stream.{stream_name}.fps", f"stream.{stream_name}.frames_published")
                self.metrics.add_collector(source.stats, prefix=f"stream.{stream_name}.source")
            if plans:
                slot_config = self.config.slots[slot_name]
                # Decided again now that the first model is loaded: its measured run time can keep
                # a small model on one worker.
                current = slot.current
                layout = self._layout(
                    slot_name,
                    current.runner.probe_ms if current is not None else None,
                    len(current.engines) if current is not None else None,
                )
                self.layouts[slot_name] = layout
                slot.parallel_runs = layout.workers
                pipelines.append(
                    SlotPipeline(
                        slot,
                        plans,
                        self.link,
                        self.metrics,
                        max_batch=layout.max_batch or slot_config.max_batch,
                        workers=layout.workers,
                    )
                )
                log.info(
                    "pipeline.layout",
                    slot=slot_name,
                    workers=layout.workers,
                    max_batch=layout.max_batch or slot_config.max_batch,
                    reason=layout.reason,
                )
        self.metrics.add_collector(self._slot_stats, prefix="slot")
        return pipelines

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

    def run_forever(self) -> None:
        """Serve until the stop event; reloads run here, on the main thread."""
        while not self.stop_event.wait(0.2):
            if self.reload_event.is_set():
                self.reload_event.clear()
                self.reload()

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the config; hot-swap every slot whose model changed. A bad config changes nothing."""
        if self.config_path is None:
            return
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, require_models=False)
        except ConfigError as exc:
            log.error("config.reload.invalid", problems=exc.problems)
            self.notifier.ready(status="reload refused: invalid config; still serving the previous one")
            return
        changes = config_changes(self.config, new)
        later = [c.key for c in changes if needs_restart(c, set(self.slots))]
        if later:
            log.warning("config.reload.restart_required", keys=later, reason="these take effect at restart")
        swapping = self.models.reload(new.slots)
        log.info(
            "config.reload.applied",
            changed={c.key: c.shown() for c in changes},
            swapping=swapping,
            restart_required=later,
        )
        # What runs now: the slots that exist (with their new settings) and the watchdog's bound; every
        # other key waits for a restart, so the next reload reports it again instead of forgetting it.
        slots = {name: new.slots.get(name, self.config.slots[name]) for name in self.slots}
        self.config = self.config.model_copy(update={"slots": slots, "watchdog": new.watchdog})
        self.notifier.ready(status=self._status_line())

    # -- engines ---------------------------------------------------------------------------------

    def _tap_frames(self, slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        self._pipelines_built.wait(FRAME_TAP_TIMEOUT_S)
        pipeline = self._pipeline(slot)
        return pipeline.tap(n, every=2, timeout_s=FRAME_TAP_TIMEOUT_S) if pipeline else []

    # -- delivery --------------------------------------------------------------------------------

    def status_report(self) -> dict[str, Any]:
        """``status`` command: slots, state.json and every metric."""
        return {
            "device_id": self.config.device_id,
            "agent_version": __version__,
            "slots": {name: slot.describe() for name, slot in self.slots.items()},
            "state": self.models.snapshot(),
            "metrics": self.metrics.snapshot(),
        }

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ordered stop: frames, inference drain, telemetry, swaps, link (flush + offline), slots."""
        deadline = time.monotonic() + STOP_BUDGET_S
        self.stop_event.set()
        self.notifier.stopping()
        for pipeline in self.pipelines:
            pipeline.stop(deadline - 2.5)
        if self.telemetry is not None:
            self.telemetry.join(max(0.1, deadline - 2.5 - time.monotonic()))
        if self.samples is not None:
            self.samples.join(max(0.1, deadline - 2.5 - time.monotonic()))
        if self.watchdog is not None:
            self.watchdog.join(1.0)
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

    def _on_model_activated(self) -> None:
        if self.link.connected:
            self._publish_info()

    def _on_job_end(self, _slot: str) -> None:
        # up/info is retained: `fleet status` shows each slot's last job and last failure from it.
        if self.link.connected:
            self._publish_info()

    def _on_connected(self, session: int) -> None:
        log.info("agent.connected", session=session)
        self._publish_info()

    def info_message(self) -> InfoMessage:
        backends = {
            name: BackendInfo(available=ok, reason=why) for name, (ok, why) in self.platform.backends.items()
        }
        slots = {}
        for name, slot in self.slots.items():
            model = slot.current
            slots[name] = SlotInfo(
                model=model.ref if model else None,
                state=slot.state.value,
                reason=None if model else slot.empty_reason,
                since=model.loaded_at if model else None,
                **self.delivery.job_fields(name),
                workers=self.layouts[name].workers,
                layout=self.layouts[name].reason,
                engines=[EngineInfo.model_validate(row) for row in model.engine_shares()] if model else None,
                serving=self.models.serving(name),
                building=_slot_build(self.models.builds.info(name)),
            )
        return InfoMessage(
            device_id=self.config.device_id,
            agent_version=__version__,
            platform=platform_summary(self.platform),
            labels=dict(self.config.labels),
            backends=backends,
            slots=slots,
            streams=list(self.config.streams),
        )

    def _publish_info(self) -> None:
        self.link.publish(self.topics.info, self.info_message(), qos=1, retain=True)

    def _publish_telemetry(self, values: dict[str, float]) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.update(values)  # before publishing: a broker outage must not hide it
        self.link.publish(self.topics.telemetry, TelemetryMessage.model_validate(values), qos=0)

    def _slot_changed(self, name: str, _old: SlotState, new: SlotState) -> None:
        self.metrics.counter(f"slot.{name}.transitions.{new.value}").inc()

    def _slot_stats(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        for name, slot in self.slots.items():
            model = slot.current
            stats[f"{name}.active"] = 1.0 if model else 0.0
            # Telemetry is numeric: the model is identified by the first 7 hex digits of its sha256.
            stats[f"{name}.model_sha7"] = float(int(model.ref.sha256[:7], 16)) if model else 0.0
            stats[f"{name}.swaps"] = float(slot.swaps)
            stats[f"{name}.failed_loads"] = float(slot.failed_loads)
        return stats

    def _frame_loop_alive(self) -> bool:
        bound = self.config.watchdog.stuck_call_s
        problems = [problem for p in self.pipelines for problem in p.problems(HEARTBEAT_STALE_S, bound)]
        if problems:
            # The watchdog's own line names only the check; this one says what is stuck, and where.
            log.warning("pipeline.stuck", problems=problems, stuck_call_s=bound)
        return not problems

    def _status_line(self) -> str:
        parts = []
        for name, slot in self.slots.items():
            model = slot.current
            parts.append(
                f"{name}={model.ref.model_id}:{model.ref.version or '-'}"
                if model
                else f"{name}=empty ({slot.empty_reason})"
            )
        return "serving " + " ".join(parts) if parts else "no slots configured"


def run(config_path: Path) -> int:
    """``edge-agent run``: start, serve until SIGTERM, stop in order. Returns the exit code."""
    config = load_config(config_path, require_models=False)
    ring = LogRing(config.logging.ring_lines, config.logging.ring_bytes)
    configure_logging(config.logging.format, config.logging.level, ring=ring)
    agent = Agent(config, config_path, ring)
    agent.install_signal_handlers()
    try:
        agent.start()
        agent.run_forever()
    finally:
        agent.stop()
    return 0


def _slot_build(info: dict[str, object] | None) -> SlotBuildInfo | None:
    return SlotBuildInfo.model_validate(info) if info is not None else None
