"""Shadow and probation benchmark: what guarding a deployment costs a live stream, as JSON.

The agent runs in this process on a camera-paced stream (a 640x480 video played at its own 30 fps,
looping) with a MobileNet-sized classifier, results to a local mosquitto. A copy of the model (same
weights: it agrees and is as fast) is deployed with the real FleetDeploy, with a shadow run and a
probation. Reported: published fps before the deploy, during the shadow, during the probation and
after ACTIVE (each over its own window, from the frame counter sampled every 0.1 s), their ratios
to before, and the time from publishing the deploy to ACTIVE with the job's own step timings.

    .venv/bin/python bench/guard.py [--shadow-frames 30] [--probation-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from agent.app.root import Agent
from agent.config import load_config
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_mobilenet_like
from agent.demo.setup import write_demo_video
from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.logs.setup import configure_logging
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState
from agent.protocol.proving import ProbationSpec, ShadowSpec

_SAMPLE_S = 0.1


def _published(agent: Agent) -> int:
    return agent.metrics.counter("stream.cam.frames_published").value


def _config(workdir: Path, port: int, model: Path, video: Path) -> Path:
    """One slot, one camera-paced looping stream, unsigned deploys accepted (a local bench)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "device_id": "bench",
        "state_dir": str(workdir / "state"),
        "mqtt": {"host": "127.0.0.1", "port": port},
        "delivery": {"require_signature": False},
        "slots": {"cls": {"model": str(model), "version": "1", "preprocess": {"width": 224, "height": 224}}},
        "streams": {
            "cam": {
                "source": {"type": "file", "path": str(video), "loop": True, "realtime": True},
                "slot": "cls",
                "drop_policy": "process_all",
                "queue_size": 8,
            }
        },
        "telemetry": {"interval_s": 60},
        "logging": {"format": "json", "level": "error"},
    }
    path = workdir / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class FrameCounter:
    """Samples the stream's published-frame counter every 0.1 s, and the job's state at that time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.samples: list[tuple[float, int]] = []
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FrameCounter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.samples.append((time.monotonic(), _published(self.agent)))

    def fps(self, start: float, end: float) -> float:
        inside = [(t, n) for t, n in self.samples if start <= t <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, n0), (t1, n1) = inside[0], inside[-1]
        return (n1 - n0) / (t1 - t0)


def main() -> int:
    configure_logging("console", "warning", stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before-s", type=float, default=8.0, help="seconds of the stream measured before")
    parser.add_argument("--after-s", type=float, default=8.0, help="seconds measured after ACTIVE")
    parser.add_argument("--shadow-frames", type=int, default=30)
    parser.add_argument("--sample-fps", type=float, default=5.0, help="shadow frames sampled per second")
    parser.add_argument("--probation-s", type=float, default=10.0)
    args = parser.parse_args()
    report: dict[str, Any] = {"cpu_count": os.cpu_count(), "stream": "640x480 MJPG file paced at 30 fps"}
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as tmp:
        workdir = Path(tmp)
        video = write_demo_video(workdir / "cam.avi", frames=300, fps=30.0)
        model = write_mobilenet_like(workdir / "heavy.onnx", input_size=224)
        candidate = workdir / "heavy-v2.onnx"
        shutil.copyfile(model, candidate)
        with Broker(workdir / "broker") as broker:
            config = _config(workdir / "agent", broker.port, model, video)
            agent = Agent(load_config(config), config)
            agent.start()
            counter = FrameCounter(agent).start()
            try:
                report.update(_run(agent, counter, broker, candidate, args))
            finally:
                counter.stop()
                agent.stop()
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def _run(agent: Agent, counter: FrameCounter, broker: Broker, candidate: Path, args: Any) -> dict[str, Any]:
    time.sleep(2.0)  # warm-up: the first frames include session start and the first decode
    before_start = time.monotonic()
    time.sleep(args.before_s)
    marks: dict[JobState, float] = {}
    plan = DeployPlan(
        model=candidate,
        devices=("bench",),
        slot="cls",
        version="2",
        model_id="cls",
        shadow=ShadowSpec(frames=args.shadow_frames, sample_fps=args.sample_fps),
        probation_s=args.probation_s,
        probation=ProbationSpec(),
    )
    deployed = time.monotonic()
    deploy = FleetDeploy(
        MqttSettings(host=broker.host, port=broker.port),
        plan,
        signing_key=None,
        key_id=None,
        status_poll_s=1.0,
        on_change=lambda devices: _mark(devices, marks),
    ).start()
    try:
        outcome = deploy.wait(args.shadow_frames / args.sample_fps + args.probation_s + 120)
    finally:
        deploy.stop()
    active = marks.get(JobState.ACTIVE, time.monotonic())
    time.sleep(args.after_s)
    progress = outcome.devices["bench"]
    before = counter.fps(before_start, deployed)
    shadow = counter.fps(
        marks.get(JobState.SHADOW, float("nan")), marks.get(JobState.PROBATION, float("nan"))
    )
    probation = counter.fps(marks.get(JobState.PROBATION, float("nan")), active)
    after = counter.fps(active, active + args.after_s)
    return {
        "state": progress.state.value if progress.state else None,
        "error_code": progress.error_code,
        "shadow_frames": args.shadow_frames,
        "sample_fps": args.sample_fps,
        "probation_s": args.probation_s,
        "fps": {"before": before, "shadow": shadow, "probation": probation, "after": after},
        "fps_over_before": {
            "shadow": shadow / before,
            "probation": probation / before,
            "after": after / before,
        },
        "deploy_to_active_s": active - deployed,
        "job_timings_s": progress.timings_s,
    }


def _mark(devices: list[DeviceProgress], marks: dict[JobState, float]) -> None:
    for device in devices:
        if device.state is not None and device.state not in marks:
            marks[device.state] = time.monotonic()


if __name__ == "__main__":
    raise SystemExit(main())
