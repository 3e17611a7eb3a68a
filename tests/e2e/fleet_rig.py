"""Deploys to real daemons in tests: a fleet of agent processes trusting the test's key, and waits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2

from agent.datasets.shapes import LABELS_PATH, MODEL_PATH, generate
from agent.demo.broker import Broker
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key
from agent.fleet.deploy.outcome import DeployOutcome
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import KIB
from agent.protocol.messages import JobStatus, decode
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

#: Guard bars for tests about job ends, not health: only NaN outputs and inference errors fail a model.
#: The latency bars are out of reach on purpose: on a loaded machine a 3-frame median or a short
#: probation's p99 of a tiny model can be many times the old model's (a job of such a test was once
#: REJECTED by the shadow's default 2x bar while the suite ran on 8 workers).
ENDS_ONLY_PROBATION = ProbationSpec(
    min_fps_ratio=0.0, max_p99_ratio=1e6, max_drop_increase=1.0, max_class_shift=None
)


def ends_only_shadow(**fields: Any) -> ShadowSpec:
    """A shadow that judges only NaN outputs and errors (see :data:`ENDS_ONLY_PROBATION`)."""
    return ShadowSpec(min_agreement=None, max_latency_ratio=1e6, **fields)


def count_version(version: str, topic: str) -> Callable[[list[Received]], bool]:
    def enough(messages: list[Received]) -> bool:
        return sum(r.model.version == version for r in unique_results(messages, topic)) >= 10

    return enough


def shapes_video(path: Path, frames: int = 90) -> Path:
    """An MJPEG video of ``frames`` generated shapes (128x128 at 30 fps) the shapes classifier knows."""
    images, _labels = generate(frames, seed=123, size=64)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), 30.0, (128, 128))
    for image in images:
        writer.write(cv2.resize(image, (128, 128), interpolation=cv2.INTER_NEAREST))
    writer.release()
    return path


def operator_settings(broker: Broker) -> MqttSettings:
    return MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.2, reconnect_max_s=1.0)


def agent_state(files: AgentFiles) -> dict[str, Any]:
    """state.json, parsed (a corrupt file fails the test here)."""
    state: dict[str, Any] = json.loads((files.root / "state" / "state.json").read_text())
    return state


#: Options of :meth:`Fleet.deploy` that belong to the deploy plan.
_PLAN_OPTIONS = ("chunk_size", "shadow", "probation_s", "probation", "build", "calib_cache", "share_engines")


class Fleet:
    """Devices of one test: files, config (trusting the test's key) and daemon processes."""

    def __init__(self, root: Path, broker: Broker, keys: KeyPairFiles) -> None:
        self.root = root
        self.broker = broker
        self.keys = keys
        self.daemons: list[Daemon] = []

    def files(self, device: str, *, loop: bool = True, **delivery: Any) -> AgentFiles:
        files = AgentFiles(self.root / device, self.broker.port, device, frames=30)
        stream = {"source": {"type": "file", "path": str(files.video), "loop": loop, "realtime": True}}
        trust = {"trusted_keys": {self.keys.key_id: str(self.keys.public)}, **delivery}
        files.write_config(stream=stream, delivery=trust)
        return files

    def shapes_files(
        self, device: str, *, video: str = "s.avi", realtime: bool = True, **sections: Any
    ) -> AgentFiles:
        """A device's files serving the bundled shapes classifier (slot ``cls``, version 1) on a video of
        generated shapes played at its own 30 fps, as a camera is (``realtime=False``: as fast as it
        decodes), trusting the test's key; ``sections`` are more top-level config sections."""
        files = self.files(device)
        source = {"type": "file", "path": str(shapes_video(files.root / video)), "loop": True}
        files.write_config(
            slots={
                "cls": {
                    "model": str(MODEL_PATH),
                    "model_id": "cls",
                    "version": "1",
                    "preprocess": {"width": 64, "height": 64},
                    "postprocess": {"type": "classification", "top_k": 1, "labels_file": str(LABELS_PATH)},
                }
            },
            stream={"source": {**source, "realtime": True} if realtime else source},
            delivery={"trusted_keys": {self.keys.key_id: str(self.keys.public)}},
            **sections,
        )
        return files

    def start_shapes(self, device: str) -> AgentFiles:
        """A daemon serving :meth:`shapes_files`' classifier, its video paced at 30 fps as a camera is
        (unpaced, a test's agents ran frames as fast as they could and took the cores from every test
        beside them)."""
        files = self.shapes_files(device)
        self.start(files)
        return files

    def controller_config(self, state_dir: Path, **settings: Any) -> ControllerConfig:
        """A controller of this fleet's broker that signs with the test's key (so it shares engines),
        polling device status every second; ``settings`` are more of controller.yaml's fields."""
        return ControllerConfig(
            mqtt=operator_settings(self.broker),
            state_dir=state_dir,
            signing_key=self.keys.private,
            key_id=self.keys.key_id,
            status_poll_s=1.0,
            **settings,
        )

    def start(self, files: AgentFiles) -> Daemon:
        daemon = Daemon(files.config_path, files.root / f"agent-{len(self.daemons)}.log")
        self.daemons.append(daemon)
        return daemon

    def serving_v1(self, device: str, probe: Probe) -> tuple[AgentFiles, Daemon, Topics]:
        """A device's files and daemon, started and publishing results of model version 1."""
        files = self.files(device)
        daemon = self.start(files)
        topic = Topics("fleet/v1", device)
        probe.wait_for(count_version("1", topic.results("cam")), timeout=60)
        return files, daemon, topic

    def deploy(self, model: Path, devices: list[str], version: str = "2", **options: Any) -> FleetDeploy:
        """Deploy ``model`` to ``devices``' slot ``cls``: ``chunk_size``, ``shadow``, ``probation_s``,
        ``probation``, ``build`` and ``calib_cache`` go into the plan, every other option to
        :class:`FleetDeploy`."""
        plan_options = {k: options.pop(k) for k in _PLAN_OPTIONS if k in options}
        plan = DeployPlan(
            model=model,
            devices=tuple(devices),
            slot="cls",
            version=version,
            model_id="cls",
            chunk_size=plan_options.pop("chunk_size", 4 * KIB),
            **plan_options,
        )
        return FleetDeploy(
            operator_settings(self.broker),
            plan,
            signing_key=load_signing_key(self.keys.private),
            key_id=self.keys.key_id,
            status_poll_s=2.0,
            **options,
        ).start()

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.kill()


def finish(deploy: FleetDeploy, timeout: float = 60.0) -> DeployOutcome:
    try:
        return deploy.wait(patient(timeout))
    finally:
        deploy.stop()


def results(messages: list[Received], topic: str) -> list[dict[str, Any]]:
    """Results by frame index, read as plain JSON (a NaN score arrives as null), duplicates removed."""
    seen: dict[str, dict[str, Any]] = {}
    for m in messages:
        if m.topic == topic:
            raw = json.loads(m.payload)
            seen.setdefault(raw["msg_id"], raw)
    return sorted(seen.values(), key=lambda r: r["frame_index"])


def job_statuses(probe: Probe, job_id: str, device: str) -> list[JobStatus]:
    topic = Topics("fleet/v1", device).jobs(job_id)
    return [decode(JobStatus, m.payload) for m in probe.snapshot() if m.topic == topic]


def final_status(probe: Probe, job_id: str, device: str, timeout: float = 30.0) -> JobStatus:
    """The job's terminal status as ``probe`` heard it. ``fleet deploy`` may hear the end first: the
    probe is another subscriber, so this waits for it rather than reading what it holds so far."""
    probe.wait_for(
        lambda _m: any(s.state.terminal for s in job_statuses(probe, job_id, device)), timeout=timeout
    )
    return job_statuses(probe, job_id, device)[-1]


def assert_no_gap(found: list[dict[str, Any]]) -> None:
    indexes = [r["frame_index"] for r in found]
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes))), "a frame index lost or repeated"
