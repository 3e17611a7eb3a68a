"""Composition root: builds the components, starts them in order, stops them in reverse.

One stop event ends everything. SIGTERM/SIGINT set it; SIGHUP asks for a reload (re-read the
config, hot-swap slots whose model changed). Both are handled on the main thread.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import TypeAdapter

from agent import __version__
from agent.backends.base import ProviderRequest
from agent.build.engines import EngineBuilder
from agent.build.service import EngineService
from agent.build.spec import BuildSpec
from agent.camera.preprocess_spec import PreprocessSpec
from agent.camera.source import VideoSource
from agent.config import AgentConfig, SlotConfig, load_config
from agent.delivery.jobs import DeliveryService
from agent.delivery.ledger import JobsFile
from agent.delivery.steps import ActivationRequest, BuildOutcome, JobReporter, no_build
from agent.delivery.transfer import fetch_model
from agent.errors import AgentError, BuildError, ConfigError, EngineError
from agent.fsutil import sha256_file
from agent.logs import configure_logging
from agent.mqtt.link import MqttLink
from agent.platform import detect_platform, platform_summary
from agent.postprocess.spec import PostprocessSpec
from agent.protocol.messages import BackendInfo, InfoMessage, SlotInfo, TelemetryMessage
from agent.protocol.topics import Topics
from agent.runtime.loaded import LoadedModel, ModelSource
from agent.runtime.pipeline import SlotPipeline, StreamPlan
from agent.runtime.slot import ModelSlot, SlotState
from agent.spool import Spool
from agent.state import ModelRecord, StateFile, record_activation, record_config_model
from agent.store import ModelStore
from agent.systemd import Notifier, Watchdog
from agent.telemetry import DeviceStats, Metrics, TelemetryLoop

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


def model_source(slot: SlotConfig) -> ModelSource:
    """What to load for a configured slot."""
    return ModelSource(
        path=slot.model,
        model_id=slot.model_id or slot.model.stem,
        version=slot.version,
        backend=slot.backend,
        providers=tuple(slot.providers),
        intra_op_threads=slot.intra_op_threads,
        preprocess=slot.preprocess,
        postprocess=slot.postprocess,
        max_batch=slot.max_batch,
    )


class Agent:
    """The daemon: every component, wired once."""

    def __init__(self, config: AgentConfig, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.stop_event = threading.Event()
        self.reload_event = threading.Event()
        self.metrics = Metrics()
        self.notifier = Notifier.from_env()
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_file = StateFile(config.state_dir / "state.json")
        self.state = self.state_file.load()
        self._state_lock = threading.Lock()
        self.topics = Topics(config.mqtt.prefix, config.device_id)
        self.spool = Spool(config.state_dir / "spool.sqlite")
        self.link = MqttLink(
            config.mqtt,
            client_id=config.device_id,
            status_topic=self.topics.status,
            agent_version=__version__,
            spool=self.spool,
            on_connected=self._on_connected,
        )
        self.metrics.add_collector(self.link.stats, prefix="mqtt")
        self.platform = detect_platform(config.telemetry.sysfs_root)
        self.slots = {name: ModelSlot(name, on_transition=self._slot_changed) for name in config.slots}
        self.store = ModelStore(config.state_dir / "models")
        self.engines = EngineService(
            EngineBuilder(config.state_dir, config.engines, self.platform), config.engines, self._tap_frames
        )
        self._configured: dict[str, tuple[ModelSource, BuildSpec | None, str | None]] = {}
        self._deferred_builds: list[tuple[str, ModelSource, BuildSpec]] = []
        #: Engine cache key of each engine file built for a deployment, until it is activated.
        self._engine_keys: dict[Path, tuple[str, BuildSpec]] = {}
        self._protect_engines()
        self.delivery = DeliveryService(
            config.delivery,
            device_id=config.device_id,
            topics=self.topics,
            link=self.link,
            store=self.store,
            state=JobsFile.in_dir(config.state_dir),
            fetch=partial(fetch_model, link=self.link, topics=self.topics, config=config.delivery),
            activate=self._activate_delivered,
            status=self.status_report,
            rollback=self.rollback,
            slot_specs=self._slot_specs,
            build=self._build_delivered,
            protect=self._protected_models,
            part_dir=config.state_dir / "partial",
        )
        self.delivery.register_command("calibrate", self.calibrate)
        self.pipelines: list[SlotPipeline] = []
        self._swap_threads: list[threading.Thread] = []
        self.telemetry: TelemetryLoop | None = None
        self.watchdog: Watchdog | None = None

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        self.delivery.start()  # subscribes before connecting: retained manifests arrive on connect
        self.link.start()
        for name, slot_config in self.config.slots.items():
            # Loading (and later, building) an engine can outlast systemd's start timeout.
            self.notifier.extend_timeout(INITIAL_LOAD_BUDGET_S)
            self._load_initial(name, slot_config)
        self.pipelines = self._build_pipelines()
        for pipeline in self.pipelines:
            pipeline.start()
        for name, source, build in self._deferred_builds:
            self._start_swap(name, source, build)
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
        log.info("agent.started", device=self.config.device_id, slots=list(self.slots), version=__version__)

    def _load_initial(self, name: str, slot_config: SlotConfig) -> None:
        """Come back on what the slot ran before the restart, else the config's model, else a fallback.

        A delivered (or rolled-back-to) model outlives restarts until the operator changes the model
        file the config names; then the config wins.
        """
        configured = model_source(slot_config)
        config_sha = _sha_or_none(configured.path)
        saved = self.state.slot(name)
        # (source, build request, origin), in order of preference.
        candidates: list[tuple[ModelSource, BuildSpec | None, Origin]] = []
        if saved.active is not None and saved.active.origin != "config" and saved.config_sha256 == config_sha:
            candidates.append(
                (_from_record(configured, saved.active), _build_of(saved.active), saved.active.origin)
            )
        candidates.append((configured, slot_config.build, "config"))
        candidates.extend(
            (_from_record(configured, record), _build_of(record), record.origin)
            for record in (saved.active, saved.last_known_good)
            if record is not None
        )
        self._configured[name] = (configured, slot_config.build, config_sha)
        tried: set[Path] = set()
        for candidate, build, origin in candidates:
            if candidate.path in tried or not candidate.path.exists():
                continue
            tried.add(candidate.path)
            source = candidate
            try:
                if build is not None and _needs_frames(build):
                    # Calibration needs live frames: serve the ONNX model first, build once streams run.
                    self._deferred_builds.append((name, candidate, build))
                else:
                    # A built engine comes back from the engine cache (rebuilt only if it was evicted).
                    source = self._prepared(name, candidate, build)
                self._activate(name, source, origin=origin)
                if origin != "config" or candidate.path != configured.path:
                    log.warning("agent.slot.restored", slot=name, model=source.model_id, ver=source.version)
                break
            except (EngineError, BuildError) as exc:
                log.error("agent.slot.initial_failed", slot=name, model=str(source.path), error=str(exc))
        self.state = record_config_model(self.state, name, config_sha)
        self.state_file.save(self.state)

    def _activate(self, name: str, source: ModelSource, *, origin: Origin = "config") -> LoadedModel:
        sample = self._latest_frame(name)
        loaded = self.slots[name].load(source, sample)
        record = ModelRecord(
            model_id=loaded.ref.model_id,
            version=loaded.ref.version,
            sha256=loaded.ref.sha256,
            path=str(source.model_path or source.path),
            backend=source.backend,
            engine_key=source.engine_key,
            build=source.build.model_dump(mode="json") if source.build is not None else None,
            preprocess=source.preprocess.model_dump(mode="json"),
            postprocess=_POSTPROCESS.dump_python(source.postprocess, mode="json"),  # type: ignore[arg-type]
            origin=origin,
        )
        with self._state_lock:
            self.state = record_activation(self.state, name, record)
            self.state_file.save(self.state)
        self._protect_engines()
        if self.link.connected:
            self._publish_info()
        return loaded

    def _latest_frame(self, slot: str) -> npt.NDArray[np.uint8] | None:
        for pipeline in self.pipelines:
            if pipeline.slot.name == slot:
                return pipeline.last_image
        return None

    def _build_pipelines(self) -> list[SlotPipeline]:
        pipelines = []
        for slot_name, slot in self.slots.items():
            plans = []
            for stream_name, stream in self.config.streams.items():
                if stream.slot != slot_name:
                    continue
                source = VideoSource(stream_name, stream.source)
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
                pipelines.append(
                    SlotPipeline(
                        slot,
                        plans,
                        self.link,
                        self.metrics,
                        max_batch=slot_config.max_batch,
                        workers=slot_config.inference_workers,
                    )
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
        if set(new.slots) != set(self.config.slots) or new.streams != self.config.streams:
            log.warning("config.reload.restart_required", reason="slots or streams changed; restart to apply")
        for name, slot_config in new.slots.items():
            if name not in self.slots:
                continue
            source = model_source(slot_config)
            wanted = (source, slot_config.build, _sha_or_none(source.path))
            if self._configured.get(name) == wanted and self.slots[name].current is not None:
                continue
            self._configured[name] = wanted
            self._start_swap(name, source, slot_config.build)
        self.config = new.model_copy(update={"streams": self.config.streams, "slots": new.slots})
        self.notifier.ready(status=self._status_line())

    def _start_swap(self, name: str, source: ModelSource, build: BuildSpec | None) -> None:
        thread = threading.Thread(
            target=self._swap, args=(name, source, build), name=f"swap-{name}", daemon=True
        )
        self._swap_threads.append(thread)
        thread.start()

    def _swap(self, name: str, source: ModelSource, build: BuildSpec | None = None) -> None:
        try:
            self._activate(name, self._prepared(name, source, build))
        except (EngineError, BuildError) as exc:
            log.error("slot.swap.rejected", slot=name, error=str(exc))
            self.metrics.counter(f"slot.{name}.swap_failures").inc()

    # -- engines ---------------------------------------------------------------------------------

    def _prepared(self, name: str, source: ModelSource, build: BuildSpec | None) -> ModelSource:
        """``source`` as the engine its build request asks for (built, or found in the cache)."""
        if build is None:
            return source
        prepared = self.engines.prepare(
            name,
            source.path,
            build,
            source.preprocess,
            progress=lambda message: log.info("engine.build.progress", slot=name, message=message),
        )
        artifact = prepared.artifact
        log.info(
            "engine.ready",
            slot=name,
            key=artifact.key,
            cache_hit=artifact.cache_hit,
            effective=prepared.effective,
        )
        return replace(
            source,
            path=artifact.engine_path,
            backend=artifact.backend,
            providers=tuple(artifact.providers),
            extra=tuple(artifact.load_extra.items()),
            sha256=sha256_file(source.path),
            model_path=source.path,
            engine_key=artifact.key,
            build=build,
        )

    def _tap_frames(self, slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        for pipeline in self.pipelines:
            if pipeline.slot.name == slot:
                return pipeline.tap(n, every=2, timeout_s=FRAME_TAP_TIMEOUT_S)
        return []

    def _build_delivered(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        """A deployment's BUILDING step: the manifest's build request, else the slot's configured one."""
        slot = reporter.slot or ""
        slot_config = self.config.slots.get(slot)
        spec = spec if spec is not None else (slot_config.build if slot_config else None)
        if spec is None or slot_config is None:
            return no_build(model, spec, reporter)
        preprocess = reporter.preprocess or slot_config.preprocess
        steps = 0

        def progress(message: str) -> None:
            # The builder reports steps (plan, calibrate, build, cache), not a percentage: each step
            # moves the job's BUILDING progress part of the way towards done.
            nonlocal steps
            steps += 1
            reporter.progress(min(0.95, 1.0 - 0.7**steps))
            log.info("engine.build.progress", slot=slot, message=message)

        prepared = self.engines.prepare(
            slot, model, spec, preprocess, progress=progress, cancel=reporter.cancel
        )
        reporter.progress(1.0)
        self._engine_keys[prepared.artifact.engine_path] = (prepared.artifact.key, spec)
        return BuildOutcome(
            engine_path=prepared.artifact.engine_path,
            backend=prepared.artifact.backend,
            effective=prepared.effective,
            load_extra=prepared.load_extra,
        )

    def calibrate(self, args: dict[str, Any]) -> dict[str, Any]:
        """``calibrate`` command: ``{"slot": S, "frames": N}`` from the slot's live streams."""
        slot = str(args.get("slot", ""))
        if slot not in self.slots or self.slots[slot].current is None:
            raise AgentError(f"no active slot named {slot!r} to calibrate")
        frames = int(args.get("frames", 200))
        current = self.slots[slot].current
        assert current is not None
        model = current.source.model_path or current.source.path
        return self.engines.calibrate(slot, model, current.source.preprocess, frames)

    # -- delivery --------------------------------------------------------------------------------

    def _activate_delivered(self, request: ActivationRequest) -> None:
        """A deployment's engine into its slot (raises EngineError: the old model keeps serving)."""
        slot_config = self.config.slots[request.slot]
        current = self.slots[request.slot].current
        base = current.source if current is not None else model_source(slot_config)
        built = self._engine_keys.pop(request.engine_path, None)
        source = replace(
            base,
            path=request.engine_path,
            model_id=request.model_id,
            version=request.version,
            backend=request.backend,
            preprocess=request.preprocess or base.preprocess,
            postprocess=request.postprocess or base.postprocess,
            providers=_providers(request.load_extra.get("providers"), base.providers),
            extra=tuple((k, v) for k, v in request.load_extra.items() if k != "providers"),
            sha256=request.sha256,
            model_path=request.model_path,
            engine_key=built[0] if built else None,
            build=built[1] if built else None,
        )
        self._activate(request.slot, source, origin="delivery")

    def _slot_specs(self, slot: str) -> tuple[PreprocessSpec, PostprocessSpec] | None:
        if slot not in self.slots:
            return None
        current = self.slots[slot].current
        if current is not None:
            return current.source.preprocess, current.source.postprocess  # type: ignore[return-value]
        slot_config = self.config.slots[slot]
        return slot_config.preprocess, slot_config.postprocess

    def _protect_engines(self) -> None:
        """The engine cache's eviction never removes an active or last-known-good engine."""
        with self._state_lock:
            records = [r for s in self.state.slots.values() for r in (s.active, s.last_known_good) if r]
        self.engines.builder.protect({r.engine_key for r in records if r.engine_key})

    def _protected_models(self) -> set[str]:
        with self._state_lock:
            records = [r for s in self.state.slots.values() for r in (s.active, s.last_known_good) if r]
        return {r.sha256 for r in records}

    def rollback(self, slot: str) -> dict[str, Any]:
        """``rollback`` command: make the slot's last-known-good model active again."""
        if slot not in self.slots:
            raise AgentError(f"no slot named {slot!r} (slots: {', '.join(sorted(self.slots))})")
        record = self.state.slot(slot).last_known_good
        if record is None or not Path(record.path).exists():
            raise AgentError(f"slot {slot!r} has no last-known-good model to roll back to")
        current = self.slots[slot].current
        base = current.source if current is not None else model_source(self.config.slots[slot])
        source = self._prepared(slot, _from_record(base, record), _build_of(record))
        loaded = self._activate(slot, source, origin="rollback")
        return {"slot": slot, "model": loaded.ref.model_dump()}

    def status_report(self) -> dict[str, Any]:
        """``status`` command: slots, state.json and every metric."""
        return {
            "device_id": self.config.device_id,
            "agent_version": __version__,
            "slots": {name: slot.describe() for name, slot in self.slots.items()},
            "state": self.state.model_dump(mode="json"),
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
        if self.watchdog is not None:
            self.watchdog.join(1.0)
        for thread in self._swap_threads:
            thread.join(max(0.1, deadline - 2.5 - time.monotonic()))
        self.delivery.stop(timeout=max(0.1, deadline - 2.0 - time.monotonic()))
        self.link.stop(timeout=max(0.5, deadline - time.monotonic()))
        for slot in self.slots.values():
            slot.close()
        self.spool.close()
        log.info("agent.stopped")

    # -- reporting ---------------------------------------------------------------------------

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
                since=model.loaded_at if model else None,
                last_job=self.delivery.last_job(name),
            )
        return InfoMessage(
            device_id=self.config.device_id,
            agent_version=__version__,
            platform=platform_summary(self.platform),
            backends=backends,
            slots=slots,
            streams=list(self.config.streams),
        )

    def _publish_info(self) -> None:
        self.link.publish(self.topics.info, self.info_message(), qos=1, retain=True)

    def _publish_telemetry(self, values: dict[str, float]) -> None:
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
        return all(p.healthy(HEARTBEAT_STALE_S) for p in self.pipelines)

    def _status_line(self) -> str:
        parts = []
        for name, slot in self.slots.items():
            model = slot.current
            parts.append(
                f"{name}={model.ref.model_id}:{model.ref.version or '-'}" if model else f"{name}=empty"
            )
        return "serving " + " ".join(parts) if parts else "no slots configured"


def _providers(requested: Any, default: tuple[ProviderRequest, ...]) -> tuple[ProviderRequest, ...]:
    return tuple(requested) if requested else default


def _build_of(record: ModelRecord) -> BuildSpec | None:
    """The build request a recorded engine was made with (None: the ONNX model ran as it is)."""
    return BuildSpec.model_validate(record.build) if record.build else None


def _needs_frames(build: BuildSpec) -> bool:
    return build.calibration is not None and build.calibration.kind == "stream"


def _sha_or_none(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None


def _from_record(configured: ModelSource, record: ModelRecord) -> ModelSource:
    """The slot's configured source, pointed at a model recorded in state.json."""
    preprocess = PreprocessSpec.model_validate(record.preprocess) if record.preprocess else None
    postprocess = _POSTPROCESS.validate_python(record.postprocess) if record.postprocess else None
    return replace(
        configured,
        path=Path(record.path),
        model_id=record.model_id,
        version=record.version,
        backend="onnxruntime" if record.path.endswith(".onnx") else record.backend,
        preprocess=preprocess or configured.preprocess,
        postprocess=postprocess or configured.postprocess,
        sha256=None,
        model_path=None,
    )


def _same_file(sha256: str, path: Path) -> bool:
    try:
        return sha256_file(path) == sha256
    except OSError:
        return False


def run(config_path: Path) -> int:
    """``edge-agent run``: start, serve until SIGTERM, stop in order. Returns the exit code."""
    config = load_config(config_path, require_models=False)
    configure_logging(config.logging.format, config.logging.level)
    agent = Agent(config, config_path)
    agent.install_signal_handlers()
    try:
        agent.start()
        agent.run_forever()
    finally:
        agent.stop()
    return 0
