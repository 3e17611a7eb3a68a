"""One simulated device: the agent's own link, spool, store, job ledger and delivery service.

Wired as :class:`agent.app.root.Agent` wires them (same classes, same arguments), with two differences:
the slots are :class:`~agent.fleetsim.slot.SimSlots` (no engines, no frames) and the job ledger is
a :class:`JournaledJobs`, the real ``jobs.json`` that also tells a :class:`JobJournal` every state
it records, so the simulator can count how often each job ran on each device.

``up/info`` is the real :class:`~agent.protocol.messages.InfoMessage` with the delivery service's job
fields and a simulated Jetson platform; ``up/telemetry`` carries the link's and the spool's real
counters beside plausible frame-path figures (the names the agent publishes, docs/operations.md).
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent import __version__
from agent.delivery.jobs.ledger import JobRecord, JobsFile
from agent.delivery.jobs.steps import ActivationRequest, ProgressFn, no_build
from agent.delivery.service import DeliveryService
from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.pull import PullStats, fetch_model
from agent.fleetsim.agent_release import SimAgentRelease
from agent.fleetsim.build import BuildCounters, SimBuilds, SimPlatform, sim_platform
from agent.fleetsim.plan import DevicePlan
from agent.fleetsim.slot import SimSlots
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.protocol.device_targets import AGENT_TARGET, AgentRelease
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import BackendInfo, InfoMessage, ModelRef, SlotInfo, TelemetryMessage
from agent.protocol.topics import Topics
from agent.signing import Ed25519PublicKey
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.spool.queue import Spool
from agent.spool.settings import SpoolSettings
from agent.store import ModelStore

#: PullStats fields that are a largest value, not a count (the others are summed over pulls).
_PULL_MAXIMA = ("max_at_risk", "timeout_ms", "server_wait_ms")
#: The simulated link's longest idle turn (the agent's: 0.5 s). Everything another thread asks of a
#: link wakes it at once, so this only paces keepalive (30 s): a thousand idle links on two cores
#: turn 500 times a second instead of 2,000 (bench/fleetsim_idle.py).
LINK_IDLE_LOOP_S = 2.0
#: The one simulated camera stream of every device.
STREAM = "cam0"
_FPS = 29.8


@dataclass(frozen=True)
class SlotSetup:
    """One slot of every simulated device: its pre/postprocessing and the model it serves at start."""

    preprocess: PreprocessSpec
    postprocess: PostprocessSpec
    model: ModelRef | None = None
    #: The file of ``model``, linked into each device's store (so a rollback to it needs no download).
    model_path: Path | None = None


@dataclass(frozen=True)
class FleetSetup:
    """What every device of a simulator process shares: the broker, the trusted keys, the slots."""

    mqtt: MqttSettings
    state_dir: Path
    trusted: Mapping[str, Ed25519PublicKey]
    slots: Mapping[str, SlotSetup]
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    spool: SpoolSettings = field(default_factory=SpoolSettings)
    #: Seconds of the simulated engine build a delivered model needs (0: no engine, the ONNX file as is).
    build_seconds: float = 0.0
    #: The slots' models came from a deployment that shared engines: a start-up build asks the fleet.
    share_at_start: bool = False
    #: The agent release every device runs at start (the wheels it holds); None: none reported.
    agent_release: AgentRelease | None = None


def add_pull_counters(totals: collections.Counter[str], counters: Mapping[str, int]) -> None:
    """Add one pull's (or one device's) PullStats counters to ``totals``: summed, maxima kept as maxima."""
    for key, value in counters.items():
        totals[key] = max(totals[key], value) if key in _PULL_MAXIMA else totals[key] + value


class JobJournal:
    """Every job state one device recorded, in order, per job id (kept across simulated restarts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.jobs: dict[str, list[str]] = {}
        self.fetched_bytes = 0
        #: The MQTT pulls' counters (agent/delivery/transfer/pull.py PullStats), summed over the pulls.
        self.pull: collections.Counter[str] = collections.Counter()
        #: The agent release it runs (the simulated ``_agent`` target's), once one was delivered.
        self.agent_release: str | None = None

    def note(self, job_id: str, state: str) -> None:
        with self._lock:
            self.jobs.setdefault(job_id, []).append(state)

    def add_fetched(self, size: int) -> None:
        with self._lock:
            self.fetched_bytes += size

    def set_agent_release(self, version: str) -> None:
        with self._lock:
            self.agent_release = version

    def add_pull(self, stats: PullStats) -> None:
        with self._lock:
            add_pull_counters(self.pull, stats.as_dict())

    def snapshot(self) -> dict[str, Any]:
        """``{"jobs": {job_id: [states]}, "runs": {job_id: times QUEUED}, "fetched_bytes": n, "pull": {}}``.

        ``pull``: the pulls' counters (PullStats fields, summed; maxima for the maxima).
        """
        with self._lock:
            jobs = {job: list(states) for job, states in self.jobs.items()}
            fetched = self.fetched_bytes
            pull = dict(self.pull)
            release = self.agent_release
        return {
            "agent_release": release,
            "jobs": jobs,
            "runs": {job: states.count("QUEUED") for job, states in jobs.items()},
            "fetched_bytes": fetched,
            "pull": pull,
        }


class JournaledJobs(JobsFile):
    """The real ``jobs.json`` ledger, telling ``journal`` each state it records."""

    def __init__(self, path: Path, journal: JobJournal) -> None:
        super().__init__(path)
        self.journal = journal

    def record(self, record: JobRecord) -> None:
        super().record(record)
        self.journal.note(record.job_id, record.state.value)

    def remember_ended(self, job_id: str) -> None:
        super().remember_ended(job_id)
        self.journal.note(job_id, "REFUSED")


def _platform(platform: SimPlatform) -> dict[str, str | bool | int | float | None]:
    """A plausible Orin's ``platform_summary`` (:func:`agent.fleetsim.build.sim_platform`)."""
    return {
        "is_jetson": True,
        "machine": "aarch64",
        "device_model": platform.device_model,
        "soc": "tegra234",
        "soc_family": "orin",
        "l4t_release": platform.l4t_release,
        "jetpack": platform.jetpack,
        "cuda_driver": platform.cuda_version,
        "cuda_runtime": platform.cuda_version,
        "gpu_name": platform.gpu_name,
        "compute_capability": platform.compute_capability,
        "dla_cores": platform.dla_cores,
        "tensorrt_version": platform.tensorrt_version,
        "onnxruntime_version": "1.18.0",
        "ort_providers": "CPUExecutionProvider",
        "simulated": True,
    }


def link_model(source: Path, store: ModelStore, sha256: str) -> None:
    """Put ``source`` into ``store`` as model ``sha256`` (a hard link: 1,000 devices, one copy on disk)."""
    target = store.path_for(sha256)
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)  # another file system


class _SimDelivery(DeliveryService):
    """The agent's delivery service, with the ``_agent`` target routed to the simulated install (the
    job runner of this tree takes slots only)."""

    def __init__(self, agent: SimAgentRelease, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._agent = agent

    def handle_desired(self, message: InboundMessage) -> None:
        if message.topic.rsplit("/", 1)[-1] == AGENT_TARGET:
            self._agent.take(message)
            return
        super().handle_desired(message)


class SimDevice:
    """One device: ``start()`` connects it, ``stop()`` stops it as the agent stops (offline status)."""

    def __init__(
        self,
        plan: DevicePlan,
        setup: FleetSetup,
        slots: SimSlots,
        journal: JobJournal,
        *,
        counters: BuildCounters | None = None,
        upgraded: bool = False,
    ) -> None:
        self.plan = plan
        self.setup = setup
        self.slots = slots
        self.journal = journal
        self.platform = sim_platform(plan.labels, upgraded=upgraded)
        self.started_at = time.time()
        self._rng = random.Random(plan.index)
        root = setup.state_dir / plan.device_id
        root.mkdir(parents=True, exist_ok=True)
        self.topics = Topics(setup.mqtt.prefix, plan.device_id)
        self.spool = Spool(root / "spool.sqlite", setup.spool)
        self.link = MqttLink(
            setup.mqtt,
            client_id=plan.device_id,
            status_topic=self.topics.status,
            agent_version=__version__,
            spool=self.spool,
            on_connected=lambda _session: self.publish_info(),
            idle_loop_s=LINK_IDLE_LOOP_S,
        )
        self.store = ModelStore(root / "models")
        self.builds: SimBuilds | None = None
        if setup.build_seconds > 0:
            self.builds = SimBuilds(
                root=root,
                link=self.link,
                topics=self.topics,
                trusted=setup.trusted,
                fetch=self._fetch_engine,
                platform=self.platform,
                build_seconds=setup.build_seconds,
                counters=counters or BuildCounters(),
            )
            if not upgraded:  # provisioned with its models' engines: only an upgrade changes the keys
                for sha in self._slot_models().values():
                    self.builds.seed(sha)
        self._stopped = threading.Event()
        for slot in setup.slots.values():
            if slot.model is not None and slot.model_path is not None:
                link_model(slot.model_path, self.store, slot.model.sha256)
        if setup.agent_release is not None and journal.agent_release is None:
            journal.set_agent_release(setup.agent_release.version)
        self.agent = SimAgentRelease(
            device_id=plan.device_id,
            root=root,
            link=self.link,
            topics=self.topics,
            delivery=setup.delivery,
            trusted=setup.trusted,
            running=setup.agent_release,
            note=journal.note,
            add_fetched=journal.add_fetched,
            add_pull=journal.add_pull,
            on_release=journal.set_agent_release,
            on_change=self.publish_info,
        )
        self.delivery = _SimDelivery(
            self.agent,
            setup.delivery,
            device_id=plan.device_id,
            topics=self.topics,
            link=self.link,
            store=self.store,
            state=JournaledJobs(root / "jobs.json", journal),
            fetch=self._fetch,
            activate=self._activate,
            status=self._status,
            rollback=slots.rollback,
            slot_specs=slots.slot_specs,
            build=self.builds.build if self.builds is not None else no_build,
            protect=slots.protected_models,
            part_dir=root / "partial",
            trusted_keys=setup.trusted,
            on_job_end=lambda _slot: self.publish_info(),
            on_job_phase=lambda _slot: self.publish_info(),
        )
        slots.on_change = self.publish_info

    def _fetch(
        self, manifest: DeployManifest, part_dir: Path, progress: ProgressFn, cancel: threading.Event
    ) -> Path:
        path = self._fetch_engine(manifest, part_dir, progress, cancel, on_pull=self.journal.add_pull)
        self.journal.add_fetched(manifest.size)
        return path

    def _fetch_engine(
        self,
        manifest: DeployManifest,
        part_dir: Path,
        progress: ProgressFn,
        cancel: threading.Event,
        on_pull: Callable[[PullStats], None] | None = None,
    ) -> Path:
        """A fleet engine's file, and (with ``on_pull``: counted as model bytes) a model's: one MQTT pull."""
        return fetch_model(
            manifest,
            part_dir,
            progress,
            cancel,
            link=self.link,
            topics=self.topics,
            config=self.setup.delivery,
            on_pull=on_pull,
        )

    def _activate(self, request: ActivationRequest) -> None:
        """The slot's stand-in activation; then the engine is offered as the real runtime offers it."""
        guarded = self.slots.current(request.slot)[0] is not None
        self.slots.activate(request)
        if self.builds is not None:
            self.builds.counters.ready()
            self.builds.offer_when_active(request, guarded=guarded)

    def _slot_models(self) -> dict[str, str]:
        """The SHA-256 of the model each slot serves (empty slots left out)."""
        models = {}
        for name in self.slots.names():
            model, _since = self.slots.current(name)
            if model is not None:
                models[name] = model.sha256
        return models

    def start(self) -> None:
        """Subscribe, then connect (as the agent: retained manifests arrive on connect). A slot whose
        engine is not in the cache serves its ONNX model at once while the engine builds."""
        if self.builds is not None:
            self.builds.start_up(
                self._slot_models(),
                self._stopped,
                on_ready=self.publish_info,
                share=self.setup.share_at_start,
            )
        self.delivery.start()
        self.link.start()

    def stop(self, timeout: float = 5.0) -> None:
        """The agent's ordered stop: jobs cancelled (they resume at the next start), offline, closed."""
        self.slots.on_change = None
        self._stopped.set()
        self.agent.stop()
        self.delivery.stop(timeout=timeout / 2)
        self.link.stop(timeout=timeout / 2)
        self.spool.close()

    # -- what the device publishes ---------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        """The ``status`` command's reply (``delivery`` is added by the delivery service)."""
        return {
            "device_id": self.plan.device_id,
            "agent_version": __version__,
            "slots": self.slots.describe(),
            "simulated": True,
        }

    def info_message(self) -> InfoMessage:
        """``up/info`` as the agent builds it, the slots from the simulated ones."""
        slots = {}
        for name in self.slots.names():
            model, since = self.slots.current(name)
            slots[name] = SlotInfo(
                model=model,
                state="active" if model else "empty",
                reason=None if model else "no model delivered yet",
                since=since,
                serving=self._serving(name) if model else None,
                **self.delivery.job_fields(name),
            )
        return InfoMessage(
            device_id=self.plan.device_id,
            agent_version=__version__,
            platform=_platform(self.platform),
            labels=dict(self.plan.labels),
            backends={"onnxruntime": BackendInfo(available=True), "tensorrt": BackendInfo(available=True)},
            slots=slots,
            streams=[STREAM],
            agent_release=self.agent.info,
        )

    def _serving(self, slot: str) -> Literal["requested", "interim"]:
        """``interim`` while the slot's engine builds at start (its ONNX model serves meanwhile)."""
        if self.builds is not None and self.builds.serving(slot) == "interim":
            return "interim"
        return "requested"

    def publish_info(self) -> None:
        if self.link.connected:
            self.link.publish(self.topics.info, self.info_message(), qos=1, retain=True)

    def telemetry(self) -> dict[str, float]:
        """One ``up/telemetry`` sample: the link's and spool's real counters, simulated frame figures."""
        rng = self._rng
        up_s = time.time() - self.started_at
        values: dict[str, float] = {f"mqtt.{k}": v for k, v in self.link.stats().items()}
        values.update({f"spool.{k}": v for k, v in self.spool.stats().items()})
        values.update(
            {
                f"stream.{STREAM}.fps": round(_FPS + rng.uniform(-0.4, 0.2), 2),
                f"stream.{STREAM}.frames_published": float(int(_FPS * up_s)),
                f"stream.{STREAM}.dropped.queue_full": 0.0,
                f"stream.{STREAM}.latency.total.p95_ms": round(rng.uniform(9.0, 12.0), 2),
                "process.cpu_percent": round(rng.uniform(20.0, 40.0), 1),
                "process.rss_mb": round(rng.uniform(300.0, 340.0), 1),
                "cpu.percent": round(rng.uniform(25.0, 55.0), 1),
                "memory.percent": round(rng.uniform(35.0, 50.0), 1),
                "gpu.load_percent": round(rng.uniform(30.0, 70.0), 1),
                "temp.cpu_therm_c": round(rng.uniform(45.0, 60.0), 1),
                "temp.gpu_therm_c": round(rng.uniform(44.0, 58.0), 1),
            }
        )
        for name in self.slots.names():
            model, _since = self.slots.current(name)
            values[f"slot.{name}.active"] = 1.0 if model else 0.0
            values[f"slot.{name}.model_sha7"] = float(int(model.sha256[:7], 16)) if model else 0.0
            values[f"slot.{name}.latency.infer.p95_ms"] = round(rng.uniform(6.5, 8.5), 2)
        return values

    def publish_telemetry(self) -> None:
        if self.link.connected:
            self.link.publish(self.topics.telemetry, TelemetryMessage.model_validate(self.telemetry()), qos=0)
