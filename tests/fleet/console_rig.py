"""Parts of the console tests (no tests here): protocol messages of simulated devices, a rollout in a
real RolloutStore, and the console's actions done on that store.

The devices are simulated: what they send is built from the real protocol models
(:mod:`agent.protocol.messages`) and encoded as an agent encodes it; the tests either hand the
messages to a :class:`FleetView` directly or publish them through a real mosquitto.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from agent.config.models import SnapshotConfig
from agent.fleet.devices.evidence import DeviceEvidence, evidence_json, frame_from_reply
from agent.fleet.devices.snapshot import snapshot_from_reply, snapshot_json
from agent.fleet.rollout.gate import GateFigures
from agent.fleet.rollout.records import RolloutPlan, RolloutState
from agent.fleet.rollout.store import RolloutStore, RolloutStoreError
from agent.fleet.view.live import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.command_args import EvidenceArgs, SnapshotArgs
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import (
    CameraInfo,
    CommandReply,
    FailedFigure,
    InfoMessage,
    JobState,
    JobStatus,
    ModelRef,
    ProbationFigures,
    ResultMessage,
    ShadowFigures,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.topics import Topics
from agent.runtime.frames.snapshot_command import SnapshotCommand
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.runtime.slots.evidence import EvidenceCommand, EvidenceStore


def status(prefix: str, device: str, state: str = "online", session: int = 1) -> tuple[str, bytes]:
    """A device's retained ``up/status`` (topic, payload)."""
    message = StatusMessage(state=state, session=session, agent_version="0.3.1")
    return Topics(prefix, device).status, encode(message)


#: The failure the rig's second camera reports, as an agent words it (the password already stripped).
DOCK_ERROR = (
    "cannot open camera stream rtsp://***@10.0.4.21:554/main: check that the camera is reachable "
    "and the URL, path and credentials are right"
)


def info(
    prefix: str,
    device: str,
    *,
    site: str = "berlin",
    model: str = "mobilenet",
    version: str = "4",
    config: TargetInfo | None = None,
    agent_release: TargetInfo | None = None,
) -> tuple[str, bytes]:
    """A device's retained ``up/info``: one slot ``main`` serving ``model:version``, labels ``site``,
    camera ``cam0`` streaming and camera ``dock`` reconnecting after :data:`DOCK_ERROR`; its
    configuration and agent release when given."""
    now = time.time()
    message = InfoMessage(
        device_id=device,
        agent_version="0.3.1",
        platform={
            "device_model": "Jetson Orin NX",
            "jetpack": "6.0",
            "tensorrt_version": "8.6.2",
            "dla_cores": 2,
        },
        labels={"site": site},
        backends={},
        slots={
            "main": SlotInfo(
                model=ModelRef(slot="main", model_id=model, version=version, sha256="ab" * 32),
                state="active",
                last_job=f"job-{version}",
                last_job_state=JobState.ACTIVE,
            )
        },
        streams=["cam0", "dock"],
        cameras={
            "cam0": CameraInfo(state="streaming", since=now - 3600, frames=90000, reconnects=0),
            "dock": CameraInfo(
                state="reconnecting",
                since=now - 130,
                frames=5120,
                reconnects=14,
                last_error=DOCK_ERROR,
                last_error_at=now - 130,
            ),
        },
        config=config,
        agent_release=agent_release,
    )
    return Topics(prefix, device).info, encode(message)


def telemetry(prefix: str, device: str, fps: float, ts: float | None = None) -> tuple[str, bytes]:
    """A device's ``up/telemetry`` with the figures the console shows (docs/operations.md names)."""
    fields = {
        "stream.cam0.fps": fps,
        "stream.cam0.latency.total.p50_ms": 20.0 + fps / 10,
        "stream.cam0.latency.total.p99_ms": 41.5,
        "stream.cam0.capture_fps": fps,
        "stream.cam0.source.last_frame_age_s": 0.04,
        "stream.dock.capture_fps": 0.0,
        "stream.dock.source.last_frame_age_s": 132.0,
        "cpu.percent": 37.0,
        "temp.cpu_therm_c": 51.5,
        "temp.gpu_therm_c": 49.0,
    }
    message = TelemetryMessage(**fields) if ts is None else TelemetryMessage(ts=ts, **fields)
    return Topics(prefix, device).telemetry, encode(message)


def failed_job(prefix: str, device: str, job_id: str = "job-5") -> tuple[str, bytes]:
    """A job that ran its shadow and probation, then rolled back (failure code ``unhealthy``: a
    probation figure crossed its bar, as docs/fleet.md "Error codes" lists it)."""
    message = JobStatus(
        job_id=job_id,
        slot="main",
        state=JobState.ROLLED_BACK,
        error_code="unhealthy",
        error="new model unhealthy in probation (p99_ms = 130, bar 90); slot main swapped back",
        shadow=ShadowFigures(frames=120, agreement=0.97, latency_ratio=1.4),
        probation=ProbationFigures(
            elapsed_s=30.0,
            probation_s=60.0,
            baseline={"p99_ms": 41.5},
            current={"p99_ms": 130.0},
            failed=FailedFigure(figure="p99_ms", value=130.0, bar=90.0),
        ),
    )
    return Topics(prefix, device).jobs(job_id), encode(message)


def fleet_messages(prefix: str, devices: Sequence[str], *, version: str = "4") -> Iterator[tuple[str, bytes]]:
    """Status, info and one telemetry message per device (sites alternate berlin / paris)."""
    for i, device in enumerate(devices):
        yield status(prefix, device)
        yield info(prefix, device, site="berlin" if i % 2 == 0 else "paris", version=version)
        yield telemetry(prefix, device, fps=25.0 + i % 5)


def feed(view: FleetView, messages: Iterator[tuple[str, bytes]] | Sequence[tuple[str, bytes]]) -> None:
    """Hand ``messages`` to ``view`` as the controller's MQTT client would (retained = status/info)."""
    for topic, payload in messages:
        retained = topic.endswith(("/up/status", "/up/info"))
        view.apply(InboundMessage(topic, payload, qos=1, retain=retained))


def make_rollout(store: RolloutStore, rollout_id: str, waves: Sequence[Sequence[str]]) -> None:
    """A running rollout of ``waves`` to version 5 on slot ``main`` (all devices PLANNED)."""
    store.create(
        RolloutPlan(
            rollout_id,
            "main",
            f"job-{rollout_id}",
            "5",
            waves,
            from_versions={d: "4" for wave in waves for d in wave},
            # The request part of the spec a controller stores (agent/fleet/rollout/spec.py).
            spec={
                "request": {"waves": ",".join(str(len(w)) for w in waves), "max_failed": "2%", "soak_s": 600}
            },
        )
    )


def gate_figures(ends: Mapping[str, int], *, failed: int = 0, limit: int = 0) -> dict[str, Any]:
    """A wave's figures as the controller stores them when the gate judged it (GateFigures)."""
    figures = GateFigures(
        touched=sum(ends.values()),
        ends=dict(ends),
        failed=failed,
        rolled_back=ends.get("ROLLED_BACK", 0),
        unhealthy=0,
        limit=limit,
    )
    return asdict(figures)


class StoreActions:
    """The console's actions done straight on a real RolloutStore (and FleetView), as the controller's are.

    Stands in for the fleet controller (built separately): it moves the rollout's state in the same
    store the controller watches, and raises the store's own errors for moves it refuses.
    """

    def __init__(self, store: RolloutStore, view: FleetView | None = None) -> None:
        self.store = store
        self.view = view
        self.calls: list[tuple[str, str]] = []

    def pause(self, rollout_id: str) -> str:
        self.calls.append(("pause", rollout_id))
        self.store.set_state(rollout_id, RolloutState.PAUSED, "paused from the console")
        return "paused"

    def resume(self, rollout_id: str) -> str:
        self.calls.append(("resume", rollout_id))
        self.store.set_state(rollout_id, RolloutState.RUNNING)
        return "resumed"

    def abort(self, rollout_id: str, rollback: bool) -> str:
        self.calls.append(("abort", rollout_id))
        if rollback and not self.store.devices(rollout_id):
            raise RolloutStoreError(f"rollout {rollout_id} has no devices to roll back")
        self.store.set_state(rollout_id, RolloutState.ABORTED, "aborted from the console")
        return "aborted" + (" (rolling back)" if rollback else "")

    def snapshot(self, device_id: str, stream: str | None) -> dict[str, Any]:
        """A simulated device's snapshot (:func:`simulated_snapshot`), for a device in the view."""
        self.calls.append(("snapshot", device_id))
        if self.view is None or self.view.device(device_id) is None:
            raise RolloutStoreError(f"no device {device_id!r} to ask")
        return simulated_snapshot(stream)

    def evidence(self, device_id: str, job_id: str) -> dict[str, Any]:
        """A simulated device's evidence of a rejected job (:func:`simulated_evidence`)."""
        self.calls.append(("evidence", device_id))
        if self.view is None or self.view.device(device_id) is None:
            raise RolloutStoreError(f"no device {device_id!r} to ask")
        return simulated_evidence(job_id)

    def decommission(self, device_id: str) -> str:
        """Forgets the device in the view, as the controller does once the broker cleared its topics
        (the broker's part is tests/fleet/deploy/test_decommission.py's, against a real controller)."""
        self.calls.append(("decommission", device_id))
        if self.view is None or not self.view.forget(device_id):
            raise RolloutStoreError(f"no device {device_id!r} to decommission")
        return f"device {device_id} decommissioned"


#: The simulated camera's frame: a white square on grey, and the box a detector found around it.
SNAPSHOT_SIZE = (320, 240)
SNAPSHOT_BOX = (100.0, 60.0, 200.0, 160.0)


def simulated_snapshot(stream: str | None) -> dict[str, Any]:
    """What a device's ``snapshot`` answers, made by the device's own code: a frame and its detection
    result on a :class:`SnapshotBoard`, encoded by :class:`SnapshotCommand`, then decoded and checked
    by the operator side (:func:`snapshot_from_reply`), as the controller does. Stands in for the
    MQTT round trip to a real agent (tests/e2e/test_snapshot_logs.py makes that one)."""
    width, height = SNAPSHOT_SIZE
    image = np.full((height, width, 3), 60, np.uint8)
    x1, y1, x2, y2 = (int(v) for v in SNAPSHOT_BOX)
    image[y1:y2, x1:x2] = 255
    result = ResultMessage(
        stream="cam0",
        frame_index=12,
        captured_at=1_767_225_600.0,
        published_at=1_767_225_600.1,
        model=ModelRef(slot="main", model_id="detector", version="4", sha256="ab" * 32),
        latency_ms={"total": 9.5},
        detections=[Detection(index=0, label="square", score=0.93, box=SNAPSHOT_BOX)],
    )
    board = SnapshotBoard()
    board.inferred("cam0", 12, image)
    board.published(result)
    command = SnapshotCommand(SnapshotConfig(), ["cam0"], board.latest, lambda: 256 * 1024)
    reply = CommandReply(command="snapshot", ok=True, result=command(SnapshotArgs(stream=stream)))
    return snapshot_json(snapshot_from_reply(reply))


#: The classes the simulated serving and candidate models name on each evidence frame (swapped).
EVIDENCE_CLASSES = (("cat", "dog"), ("dog", "cat"), ("bird", "fish"))


def simulated_evidence(job_id: str) -> dict[str, Any]:
    """What the ``evidence`` command answers for a class-swapped candidate, made by the device's own
    code (:class:`EvidenceStore`, :class:`EvidenceCommand`) and checked by the operator side's
    (:func:`frame_from_reply`), as the controller does. Stands in for the MQTT round trips to a real
    agent (tests/e2e/test_evidence.py makes those)."""
    store = EvidenceStore()
    heap = store.heap()
    for n, (old, new) in enumerate(EVIDENCE_CLASSES):
        image = np.full((120, 160, 3), 40 + 60 * n, np.uint8)
        serving = Prediction(classes=[ClassScore(index=n, label=old, score=0.9)])
        candidate = Prediction(classes=[ClassScore(index=n + 1, label=new, score=0.9)])
        heap.offer(0.0, image, serving, candidate)
    store.keep(
        job_id,
        slot="main",
        reason="shadow_disagrees",
        serving_model="classifier 1",
        candidate_model="classifier 2",
        heap=heap,
    )
    command = EvidenceCommand(store, lambda: 256 * 1024)
    index = command(EvidenceArgs(job_id=job_id))
    frames = [
        frame_from_reply(
            CommandReply(command="evidence", ok=True, result=command(EvidenceArgs(job_id=job_id, frame=n)))
        )
        for n in range(len(index["frames"]))
    ]
    return evidence_json(DeviceEvidence(index, frames))


def new_store(tmp_path: Path) -> RolloutStore:
    """A rollout store in a file of its own under ``tmp_path``."""
    return RolloutStore(tmp_path / "state" / "rollouts.sqlite")
