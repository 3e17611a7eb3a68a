"""Scripted devices for controller tests (no tests here): plain paho on a real mosquitto. A stand-in
for the devices of a simulated fleet, not agent code: each device publishes its retained
``up/status`` and ``up/info`` (with the model its slot runs), reads its retained desired state,
checks the signature and the device name as an agent does, and answers a job id it has not seen with
scripted job states (shadow and probation walked at once, with figures; ends chosen per device:
ACTIVE with healthy or poor shadow figures, FAILED, ROLLED_BACK, each with its failure code). A job
id it has seen is ignored, as the agent's one-terminal-state-per-job-id rule does; the fleet counts
the jobs each device started, which is what "no device deployed twice" is checked against. A device
can be offline: the desired states it gets meanwhile wait until it comes back. It answers ``status``
with its last job and ``rollback`` by putting back its last-known-good model, as the agent does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.demo.broker import Broker
from agent.protocol.device_targets import TargetInfo, target_kind
from agent.protocol.manifest import DeployManifest, parse_signed
from agent.protocol.messages import (
    CommandReply,
    FailedFigure,
    InfoMessage,
    JobState,
    JobStatus,
    ProbationFigures,
    ShadowFigures,
    StatusMessage,
    encode,
)
from agent.protocol.topics import Topics
from agent.signing import Ed25519PublicKey
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

#: Job states a healthy device walks through (shadow when the manifest asks for it).
_STEPS = (JobState.QUEUED, JobState.DOWNLOADING, JobState.VERIFYING, JobState.BUILDING, JobState.VALIDATING)


@dataclass
class ScriptedDevice:
    """One device: what its slot runs, how its jobs end, whether it is online, the jobs it started."""

    name: str
    model: dict[str, Any]
    end: JobState = JobState.ACTIVE
    error_code: str = "scripted"  # the code of an end other than ACTIVE
    agreement: float = 0.98
    online: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)  # job id -> monotonic time it started
    ended: dict[str, float] = field(default_factory=dict)
    waiting: list[Received] = field(default_factory=list)
    last: tuple[str, JobState] | None = None
    delay_s: float = 0.0  # seconds between its job's last step and its end
    previous: dict[str, Any] | None = None  # its last-known-good model (what ``rollback`` puts back)
    #: What its up/info says of its own targets beside a model slot (none: an older agent).
    config: TargetInfo | None = None
    agent_release: TargetInfo | None = None
    rollbacks: int = 0


class ScriptedFleet:
    """Devices ``names`` under ``prefix`` (see the module docstring); ``with`` starts and stops them."""

    def __init__(
        self,
        broker: Broker,
        prefix: str,
        names: list[str],
        *,
        slot: str = "cls",
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        model: Mapping[str, Any] | None = None,
    ) -> None:
        self.prefix = prefix
        self.slot = slot
        self.trusted = dict(trusted or {})
        base = dict(model or {"model_id": "old", "version": "1", "sha256": "0" * 64})
        self.devices = {n: ScriptedDevice(n, dict(base)) for n in names}
        self._probe = Probe(broker.host, broker.port)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen = 0
        self._thread = threading.Thread(target=self._run, name="scripted-fleet", daemon=True)

    def __enter__(self) -> ScriptedFleet:
        for device in self.devices.values():
            self._announce(device)
        self._probe.subscribe(f"{self.prefix}/+/down/desired/{self.slot}")
        self._probe.subscribe(f"{self.prefix}/+/down/cmd/status")
        self._probe.subscribe(f"{self.prefix}/+/down/cmd/rollback")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(patient(5.0))
        self._probe.close()

    # -- controls ----------------------------------------------------------------------------------

    def set_online(self, name: str, online: bool) -> None:
        with self._lock:
            device = self.devices[name]
            device.online = online
            held, device.waiting = device.waiting, []
        self._announce(device)
        for message in held:
            self._handle(message)

    def jobs(self) -> dict[str, list[str]]:
        with self._lock:
            return {n: list(d.jobs) for n, d in self.devices.items()}

    def models(self) -> dict[str, str]:
        """Each device's running model version (what its up/info says)."""
        with self._lock:
            return {n: str(d.model.get("version")) for n, d in self.devices.items()}

    # -- the devices -------------------------------------------------------------------------------

    def _announce(self, device: ScriptedDevice) -> None:
        topics = Topics(self.prefix, device.name)
        status = StatusMessage(
            state="online" if device.online else "offline", session=1, agent_version="0.2.0"
        )
        self._probe.publish(topics.status, encode(status), retain=True)
        # A device target (_config, _agent) is reported as such, beside no slot.
        kind = target_kind(self.slot)
        target = TargetInfo(version=str(device.model["version"]), job_id=device.model.get("job_id"))
        info = InfoMessage(
            device_id=device.name,
            agent_version="0.2.0",
            platform={},
            labels=device.labels,
            backends={},
            slots={}
            if kind != "model"
            else {self.slot: {"model": {"slot": self.slot, **device.model}, "state": "active"}},
            streams=[],
            config=target if kind == "config" else device.config,
            agent_release=target if kind == "agent" else device.agent_release,
        )
        self._probe.publish(topics.info, encode(info), retain=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            messages = self._probe.snapshot()
            fresh, self._seen = messages[self._seen :], len(messages)
            for message in fresh:
                self._handle(message)
            self._stop.wait(0.02)

    def _handle(self, message: Received) -> None:
        levels = message.topic[len(self.prefix) + 1 :].split("/")
        device = self.devices.get(levels[0])
        if device is None or not message.payload:
            return
        with self._lock:
            if not device.online:
                device.waiting.append(message)
                return
        if levels[2] == "cmd" and levels[3] == "rollback":
            self._roll_back(device, message)
            return
        if levels[2] == "cmd":
            self._reply_status(device, message)
            return
        manifest = parse_signed(message.payload, self.trusted, bool(self.trusted), device.name)
        with self._lock:
            if manifest.job_id in device.jobs:
                return  # one terminal state per job id: a job it knows is not started again
            device.jobs.append(manifest.job_id)
            device.started[manifest.job_id] = time.monotonic()
        if device.delay_s:
            # In flight for a while (a canary in probation): the other devices go on meanwhile.
            threading.Thread(target=self._walk, args=(device, manifest), daemon=True).start()
        else:
            self._walk(device, manifest)

    def _walk(self, device: ScriptedDevice, manifest: DeployManifest) -> None:
        topics = Topics(self.prefix, device.name)
        # A device target has nothing to validate on frames: installed (BUILDING), then watched.
        steps = list(_STEPS) if target_kind(manifest.slot) == "model" else list(_STEPS[:-1])
        shadow = None
        if manifest.shadow is not None:
            steps.append(JobState.SHADOW)
            shadow = ShadowFigures(frames=30, agreement=device.agreement, latency_ratio=1.0)
        probation = None
        if manifest.probation_s:
            steps.append(JobState.PROBATION)
            probation = ProbationFigures(elapsed_s=manifest.probation_s, probation_s=manifest.probation_s)
        for state in steps[:-1]:
            self._probe.publish(
                topics.jobs(manifest.job_id),
                encode(JobStatus(job_id=manifest.job_id, slot=manifest.slot, state=state)),
            )
        time.sleep(device.delay_s)
        for state in steps[-1:]:
            self._probe.publish(
                topics.jobs(manifest.job_id),
                encode(JobStatus(job_id=manifest.job_id, slot=manifest.slot, state=state)),
            )
        end = device.end
        if probation is not None and end is JobState.ROLLED_BACK and device.error_code == "unhealthy":
            # As an agent whose probation tripped reports it: the figure, its value and the bar.
            probation = ProbationFigures(
                elapsed_s=manifest.probation_s or 0.0,
                probation_s=manifest.probation_s or 0.0,
                baseline={"p99_ms": 40.0},
                current={"p99_ms": 124.0},
                failed=FailedFigure(figure="p99_ratio", value=3.1, bar=2.0),
            )
        status = JobStatus(
            job_id=manifest.job_id,
            slot=manifest.slot,
            state=end,
            shadow=shadow,
            probation=probation,
            error_code=None if end is JobState.ACTIVE else device.error_code,
            error=None if end is JobState.ACTIVE else "the script says so",
        )
        if end is JobState.ACTIVE:
            with self._lock:
                device.previous = dict(device.model)
                device.model = {
                    "model_id": manifest.model_id,
                    "version": manifest.version,
                    "sha256": manifest.sha256,
                }
                if target_kind(manifest.slot) != "model":
                    device.model["job_id"] = manifest.job_id
            self._announce(device)
        with self._lock:
            device.last = (manifest.job_id, end)
            device.ended[manifest.job_id] = time.monotonic()
        self._probe.publish(topics.jobs(manifest.job_id), encode(status))

    def _roll_back(self, device: ScriptedDevice, message: Received) -> None:
        """The ``rollback`` command: back to the last-known-good model, as the agent does."""
        with self._lock:
            ok = device.previous is not None
            if device.previous is not None:
                device.model, device.previous = device.previous, None
                device.rollbacks += 1
        if ok:
            self._announce(device)
        reply = CommandReply(command="rollback", ok=ok, error_code=None if ok else "nothing_to_roll_back")
        if message.response_topic is not None:
            self._probe.publish(
                message.response_topic, encode(reply), correlation_data=message.correlation_data
            )

    def _reply_status(self, device: ScriptedDevice, message: Received) -> None:
        if message.response_topic is None:
            return
        last = device.last
        result: dict[str, Any] = {"delivery": {"slots": {}}}
        if last is not None:
            result["delivery"]["slots"][self.slot] = {"last_job": {"job_id": last[0], "state": last[1].value}}
        reply = CommandReply(command="status", ok=True, result=result)
        self._probe.publish(message.response_topic, encode(reply), correlation_data=message.correlation_data)
