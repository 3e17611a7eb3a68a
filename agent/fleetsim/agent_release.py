"""A simulated device's agent release (target ``_agent``): SIMULATED installs, real transfers.

**Real**: the signed desired state checked as the agent checks it (signature, device, one job per
job id), the release document and every wheel the device does not hold fetched over the real chunk
pull (``fetch_model``: per-chunk SHA-256, the MQTT pull against the controller's chunk server), the
document parsed as an :class:`~agent.protocol.device_targets.AgentRelease` and refused
``agent_incompatible`` when it is not for this device's Python and machine, the job statuses on
``up/jobs/{job_id}`` and the release reported in ``up/info``'s ``agent_release``.

**Simulated**: the install. Nothing is unpacked, no environment is made and no agent restarts: a
fetched wheel is only remembered as held (by SHA-256), and the new release is confirmed at once
after PROBATION. Bytes fetched are counted per device, which is what the fleet benchmark reads: an
update that changes one wheel moves that wheel and the document, nothing else. A simulated device
switched off and on again (an offline window) starts again from the release it was started with.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog
from pydantic import ValidationError

from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.pull import PullStats, fetch_model
from agent.errors import AgentError
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.protocol.device_targets import AGENT_TARGET, AgentRelease, TargetInfo
from agent.protocol.manifest import DeployManifest, parse_signed
from agent.protocol.messages import JobState, JobStatus
from agent.protocol.topics import Topics
from agent.signing import Ed25519PublicKey

log = structlog.get_logger(__name__)

#: The machine and Python the simulated devices run (a plausible Orin's, as their up/info says).
SIM_MACHINE = "aarch64"
SIM_PYTHON = "3.10"


class SimAgentRelease:
    """One device's ``_agent`` target: :meth:`take` a desired state, the job runs on a thread."""

    def __init__(
        self,
        *,
        device_id: str,
        root: Path,
        link: MqttLink,
        topics: Topics,
        delivery: DeliveryConfig,
        trusted: Mapping[str, Ed25519PublicKey],
        running: AgentRelease | None,
        note: Callable[[str, str], None],
        add_fetched: Callable[[int], None],
        add_pull: Callable[[PullStats], None],
        on_release: Callable[[str], None],
        on_change: Callable[[], None],
    ) -> None:
        self._device = device_id
        self._root = root / "agent-release"
        self._link = link
        self._topics = topics
        self._delivery = delivery
        self._trusted = dict(trusted)
        self._note = note
        self._add_fetched = add_fetched
        self._add_pull = add_pull
        self._on_change = on_change
        self._on_release = on_release
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        #: The wheels this device holds, by SHA-256 (its running release's, then every one fetched).
        self._held = {w.sha256 for w in running.wheels} if running is not None else set()
        self._info = TargetInfo(version=running.version if running is not None else None)
        self._cancel = threading.Event()

    @property
    def info(self) -> TargetInfo:
        """What ``up/info``'s ``agent_release`` says now."""
        with self._lock:
            return self._info

    def stop(self) -> None:
        self._cancel.set()

    def take(self, message: InboundMessage) -> None:
        """A retained ``down/desired/_agent`` (on the dispatcher thread: check, then hand over)."""
        if not message.payload:
            return
        try:
            manifest = parse_signed(message.payload, self._trusted, True, self._device)
        except AgentError as exc:
            log.warning("fleetsim.agent.refused", device=self._device, code=exc.code, error=str(exc))
            return
        with self._lock:
            if manifest.job_id in self._seen:
                return  # one terminal state per job id: a job it knows is not started again
            self._seen.add(manifest.job_id)
        threading.Thread(
            target=self._run, args=(manifest,), name=f"sim-agent-{self._device}", daemon=True
        ).start()

    def _run(self, manifest: DeployManifest) -> None:
        job = manifest.job_id
        self._status(manifest, JobState.QUEUED)
        with self._lock:
            self._info = self._info.model_copy(update={"pending": manifest.version})
        self._on_change()
        try:
            self._status(manifest, JobState.DOWNLOADING)
            work = self._root / job
            document = self._fetch(manifest, work / "document")
            release = AgentRelease.model_validate_json(document.read_bytes())
            for artifact in manifest.artifacts or ():
                if artifact.kind == "wheel" and artifact.sha256 not in self.held():
                    self._fetch(manifest.for_artifact(artifact), work / artifact.sha256)
                    with self._lock:
                        self._held.add(artifact.sha256)
            self._status(manifest, JobState.VERIFYING)
            if release.python != SIM_PYTHON or SIM_MACHINE not in release.platforms:
                self._end(
                    manifest,
                    JobState.REJECTED,
                    "agent_incompatible",
                    f"release for Python {release.python} on {', '.join(release.platforms)}; this device "
                    f"runs Python {SIM_PYTHON} on {SIM_MACHINE}",
                )
                return
            self._status(manifest, JobState.BUILDING)  # the simulated side-by-side install
            self._status(manifest, JobState.PROBATION)
            with self._lock:
                self._info = TargetInfo(version=manifest.version, job_id=job)
            self._on_release(manifest.version)
            self._end(manifest, JobState.ACTIVE)
        except (AgentError, ValidationError, OSError) as exc:
            self._end(manifest, JobState.FAILED, getattr(exc, "code", "agent_install_failed"), str(exc)[:300])
        finally:
            shutil.rmtree(self._root / job, ignore_errors=True)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def _fetch(self, manifest: DeployManifest, part_dir: Path) -> Path:
        part_dir.mkdir(parents=True, exist_ok=True)
        path = fetch_model(
            manifest,
            part_dir,
            lambda *_: None,
            self._cancel,
            link=self._link,
            topics=self._topics,
            config=self._delivery,
            on_pull=self._add_pull,
        )
        self._add_fetched(manifest.size)
        return path

    def _status(self, manifest: DeployManifest, state: JobState) -> None:
        self._note(manifest.job_id, state.value)
        status = JobStatus(job_id=manifest.job_id, slot=AGENT_TARGET, state=state)
        self._link.publish(self._topics.jobs(manifest.job_id), status, qos=1, durable=True)

    def _end(
        self, manifest: DeployManifest, state: JobState, code: str | None = None, error: str | None = None
    ) -> None:
        with self._lock:
            if state is not JobState.ACTIVE:
                self._info = self._info.model_copy(update={"pending": None})
        self._note(manifest.job_id, state.value)
        status = JobStatus(
            job_id=manifest.job_id, slot=AGENT_TARGET, state=state, error_code=code, error=error
        )
        self._link.publish(self._topics.jobs(manifest.job_id), status, qos=1, durable=True)
        self._on_change()
