"""An in-process delivery stack for tests: real MqttLink + spool, real broker, real store, real keys.

``fetch`` copies a real model file from a local repository (the MQTT/HTTP transfer has its own
tests); ``activate`` records what it was asked to load and can be told to fail with an EngineError,
standing in for the model slot (the daemon-level tests swap real slots); a test may pass a real
slot's ``build``/``activate`` instead (``SlotModels.build_delivered``/``activate_delivered``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.delivery.jobs.ledger import JobsFile
from agent.delivery.jobs.steps import ActivateFn, ActivationRequest, BuildFn, ProgressFn, no_build
from agent.delivery.service import DeliveryService
from agent.delivery.settings import DeliveryConfig
from agent.demo.broker import Broker
from agent.errors import EngineError
from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.protocol.delivery_errors import JobCancelledError
from agent.protocol.manifest import DeployManifest, build_manifest, sign_manifest
from agent.protocol.messages import JobState, JobStatus, decode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey, generate_keypair, private_key_from_bytes
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from agent.spool.queue import Spool
from agent.store import DiskUsageFn, ModelStore
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

SLOT = "main"
KEY_ID = "fleet-test"
PREPROCESS = PreprocessSpec(width=64, height=64)
POSTPROCESS = ClassificationSpec(top_k=3)


class LocalRepo:
    """Model files by SHA-256; ``fetch`` copies one into the part dir in blocks, reporting progress.

    ``hold``: job ids whose fetch stops half way (setting ``waiting``) until it is cancelled, so a
    test can act while a download is in progress. ``fail``: raise this instead of fetching.
    ``gate``: job ids whose fetch, once every byte is written, waits for that event (set ``at_gate``).
    """

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        self.hold: set[str] = set()
        self.waiting = threading.Event()
        self.fail: Exception | None = None
        self.fetched: list[str] = []
        self.gate: dict[str, threading.Event] = {}
        self.at_gate = threading.Event()

    def add(self, manifest: DeployManifest, path: Path) -> None:
        self.files[manifest.sha256] = path

    def fetch(
        self, manifest: DeployManifest, part_dir: Path, progress: ProgressFn, cancel: threading.Event
    ) -> Path:
        self.fetched.append(manifest.job_id)
        if self.fail is not None:
            raise self.fail
        src = self.files[manifest.sha256]
        part = part_dir / f"{manifest.sha256}.part"
        data = src.read_bytes()
        block = max(1, len(data) // 8)
        with open(part, "wb") as f:
            for offset in range(0, len(data), block):
                if offset >= len(data) // 2 and manifest.job_id in self.hold:
                    self.waiting.set()
                    cancel.wait(patient(30.0))
                if cancel.is_set():
                    raise JobCancelledError("fetch cancelled")
                f.write(data[offset : offset + block])
                progress(min(len(data), offset + block), len(data))
        gate = self.gate.get(manifest.job_id)
        if gate is not None:
            self.at_gate.set()
            gate.wait(patient(30.0))
        return part


@dataclass
class Activations:
    """Stand-in for the slot: records requests; ``fail`` makes the next activations raise EngineError."""

    requests: list[ActivationRequest] = field(default_factory=list)
    fail: str | None = None
    #: What the slot does through ``request.guard`` (SHADOW, PROBATION, figures, an outcome), as the
    #: runtime would: the job side of a guarded activation, tested without a camera.
    guard_script: Callable[[ActivationRequest], None] | None = None

    def __call__(self, request: ActivationRequest) -> None:
        assert request.engine_path.is_file(), "activate must be given an existing engine file"
        if self.fail is not None:
            raise EngineError(self.fail)
        self.requests.append(request)
        if self.guard_script is not None:
            self.guard_script(request)


@dataclass
class Keys:
    private: Ed25519PrivateKey
    public_path: Path


def make_keys(directory: Path, name: str = "fleet") -> Keys:
    private_pem, public_pem = generate_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    pub = directory / f"{name}.pub"
    pub.write_bytes(public_pem)
    return Keys(private=private_key_from_bytes(private_pem), public_path=pub)


class Harness:
    """A device: link, spool, store, jobs file, DeliveryService; plus an operator probe."""

    def __init__(
        self,
        broker: Broker,
        state_dir: Path,
        keys: Keys,
        *,
        device_id: str | None = None,
        config: dict[str, Any] | None = None,
        disk_usage: DiskUsageFn | None = None,
        repo: LocalRepo | None = None,
        activations: Activations | None = None,
        build: BuildFn = no_build,
        activate: ActivateFn | None = None,
        protect: Callable[[], set[str]] | None = None,
    ) -> None:
        self.broker = broker
        self.device_id = device_id or f"dev-{uuid.uuid4().hex[:10]}"
        self.state_dir = state_dir
        self.keys = keys
        self.topics = Topics("fleet/v1", self.device_id)
        values: dict[str, Any] = {"trusted_keys": {KEY_ID: keys.public_path}, "disk_headroom_bytes": 0}
        values.update(config or {})
        self.config = DeliveryConfig(**values)
        self.repo = repo or LocalRepo()
        self.activations = activations or Activations()
        self.rollbacks: list[str] = []
        self.job_ends: list[str] = []  # slots whose job ended, in order (the agent republishes up/info)
        #: up/info's job fields at each SHADOW/PROBATION start, as the agent republishes them then.
        self.job_phases: list[dict[str, Any]] = []
        self.spool = Spool(state_dir / "spool.sqlite")
        settings = MqttSettings(
            host=broker.host, port=broker.port, reconnect_min_s=0.05, reconnect_max_s=0.3, keepalive_s=5
        )
        self.link = MqttLink(
            settings,
            client_id=self.device_id,
            status_topic=self.topics.status,
            agent_version="0.0.test",
            spool=self.spool,
        )
        store_kwargs: dict[str, Any] = {"disk_usage": disk_usage} if disk_usage else {}
        self.store = ModelStore(state_dir / "models", **store_kwargs)
        self.jobs_file = JobsFile.in_dir(state_dir)
        self.service = DeliveryService(
            self.config,
            device_id=self.device_id,
            topics=self.topics,
            link=self.link,
            store=self.store,
            state=self.jobs_file,
            fetch=self.repo.fetch,
            activate=activate or self.activations,
            build=build,
            status=lambda: {"slots": {SLOT: {"state": "active"}}},
            rollback=self._rollback,
            protect=protect,
            slot_specs=lambda slot: (PREPROCESS, POSTPROCESS) if slot == SLOT else None,
            on_job_end=self.job_ends.append,
            on_job_phase=lambda slot: self.job_phases.append(self.service.job_fields(slot)),
        )
        self.probe = Probe(broker.host, broker.port)
        self.probe.subscribe(f"fleet/v1/{self.device_id}/up/#")
        self._started = False

    def _rollback(self, slot: str) -> dict[str, Any]:
        self.rollbacks.append(slot)
        return {"slot": slot, "model_id": "previous", "version": "1"}

    def start(self) -> Harness:
        self.service.start()
        self.link.start()
        self._started = True
        # The link subscribes before it publishes "online": once online is seen, commands arrive.
        self.probe.wait_for(lambda ms: any(m.topic == self.topics.status for m in ms))
        return self

    def stop(self) -> None:
        if self._started:
            self.service.stop(timeout=3.0)
            self.link.stop(timeout=2.0)
            self._started = False
        self.spool.close()

    def close(self) -> None:
        self.stop()
        # Leave no retained manifest behind on the shared broker.
        self.probe.publish(self.topics.desired(SLOT), b"", retain=True)
        self.probe.close()

    # -- operator side ---------------------------------------------------------------------------

    def manifest(
        self, model: Path, *, job_id: str | None = None, sequence: int = 1, **kwargs: Any
    ) -> DeployManifest:
        """A manifest for ``model`` in slot ``main``, and the model registered with the fetch."""
        values: dict[str, Any] = {
            "slot": SLOT,
            "model_id": "cls",
            "version": str(sequence),
            "chunk_size": 1024,
        }
        values.update(kwargs)
        manifest = build_manifest(
            model, job_id=job_id or f"job-{uuid.uuid4().hex[:8]}", sequence=sequence, **values
        )
        self.repo.add(manifest, model)
        return manifest

    def signed(self, manifest: DeployManifest) -> bytes:
        return sign_manifest(manifest, self.keys.private, KEY_ID)

    def deploy(self, payload: bytes, slot: str = SLOT) -> None:
        """Publish ``payload`` retained on the slot's desired topic, as `fleet deploy` does."""
        self.probe.publish(self.topics.desired(slot), payload, retain=True)

    def statuses(self, job_id: str) -> list[JobStatus]:
        return [decode(JobStatus, m.payload) for m in self.probe.on_topic(self.topics.jobs(job_id))]

    def wait_terminal(self, job_id: str, timeout: float = 15.0) -> list[JobStatus]:
        """Every status of ``job_id`` up to and including its terminal one."""
        topic = self.topics.jobs(job_id)

        def done(ms: list[Any]) -> bool:
            return any(decode(JobStatus, m.payload).state.terminal for m in ms if m.topic == topic)

        self.probe.wait_for(done, timeout)
        # The terminal status is published (after it was recorded in jobs.json) before gc runs.
        wait_until(self.service.idle, timeout, "the delivery service to become idle")
        return self.statuses(job_id)

    def jobs_json(self) -> Any:
        path = self.state_dir / "jobs.json"
        return json.loads(path.read_text()) if path.exists() else None

    def state_files(self) -> dict[str, bytes]:
        """Every file under the state dir except the spool (which changes with every message); jobs.json
        without its ``ended`` ids, which a refused manifest adds to (what a slot runs is the rest)."""
        files = {}
        for p in sorted(self.state_dir.rglob("*")):
            if p.is_file() and not p.name.startswith("spool.sqlite"):
                data = p.read_bytes()
                if p.name == "jobs.json":
                    doc = json.loads(data)
                    doc.pop("ended", None)
                    data = json.dumps(doc, sort_keys=True).encode()
                files[str(p.relative_to(self.state_dir))] = data
        return files


#: The documented run of a job that goes live (docs/protocol.md); QUEUED starts a run (again after a
#: restart: the job resumes).
HAPPY_PATH = [
    JobState.QUEUED,
    JobState.DOWNLOADING,
    JobState.VERIFYING,
    JobState.BUILDING,
    JobState.VALIDATING,
    JobState.ACTIVE,
]


def states(statuses: list[JobStatus]) -> list[JobState]:
    """The states in order, consecutive repeats (progress updates) collapsed."""
    out: list[JobState] = []
    for s in statuses:
        if not out or out[-1] is not s.state:
            out.append(s.state)
    return out
