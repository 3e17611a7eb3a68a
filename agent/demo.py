"""``edge-agent demo``: the whole agent on one machine, in about 30 seconds.

Starts a private mosquitto, writes two versions of a classifier, a detector and a video, runs the
real daemon as a subprocess, prints its results and telemetry, hot-swaps the classifier from v1 to
v2 by rewriting the config and sending SIGHUP, stops it with SIGTERM and checks that the file
stream lost no frame across the swap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from agent.localbroker import Broker
from agent.modelzoo import write_classifier, write_detector
from agent.mqtt.observer import Observer
from agent.mqtt.settings import MqttSettings

DEVICE = "demo-orin-01"
PREFIX = "fleet/v1"


def write_demo_video(
    path: Path, frames: int = 150, size: tuple[int, int] = (640, 480), fps: float = 15.0
) -> Path:
    """A video of moving coloured shapes (MJPG in AVI: readable by every OpenCV build)."""
    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path}")
    rng = np.random.default_rng(7)
    colours = [tuple(int(c) for c in rng.integers(40, 255, 3)) for _ in range(4)]
    for i in range(frames):
        image = np.full((height, width, 3), 30, np.uint8)
        t = i / frames * 2 * np.pi
        cx, cy = int(width / 2 + width / 3 * np.cos(t)), int(height / 2 + height / 3 * np.sin(t))
        cv2.circle(image, (cx, cy), 50, colours[0], -1)
        cv2.rectangle(image, (width - cx - 40, cy - 30), (width - cx + 40, cy + 30), colours[1], -1)
        cv2.putText(image, f"{i:04d}", (10, 40), cv2.FONT_HERSHEY_SIMPLEX, 1.2, (255, 255, 255), 2)
        writer.write(image)
    writer.release()
    return path


@dataclass(frozen=True)
class DemoFiles:
    """What the demo writes before it starts the agent."""

    workdir: Path
    port: int
    v1: Path
    v2: Path
    detector: Path
    video: Path

    @property
    def config_path(self) -> Path:
        return self.workdir / "agent.yaml"


def demo_config(files: DemoFiles, classifier: Path, version: str) -> dict[str, Any]:
    """The agent config the demo runs: a file stream on the classifier, a synthetic camera on the detector."""
    return {
        "device_id": DEVICE,
        "state_dir": str(files.workdir / "state"),
        "mqtt": {"host": "127.0.0.1", "port": files.port, "prefix": PREFIX, "keepalive_s": 10},
        "slots": {
            "classifier": {
                "model": str(classifier),
                "model_id": "shapes-classifier",
                "version": version,
                "preprocess": {"width": 64, "height": 64},
                "postprocess": {"type": "classification", "top_k": 3},
            },
            "detector": {
                "model": str(files.detector),
                "model_id": "toy-detector",
                "version": "1",
                "preprocess": {"width": 320, "height": 320, "resize": "letterbox"},
                "postprocess": {"type": "detection", "format": "yolov8", "labels": ["circle", "box", "text"]},
            },
        },
        "streams": {
            "lobby": {
                "source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True},
                "slot": "classifier",
                "drop_policy": "process_all",
                "results_qos": 1,
            },
            "gate": {
                "source": {"type": "synthetic", "width": 640, "height": 480, "fps": 10},
                "slot": "detector",
            },
        },
        "telemetry": {"interval_s": 5},
        "logging": {"format": "console", "level": "warning"},
    }


@dataclass
class DemoLedger:
    """What the demo saw, to judge the run at the end."""

    indices: dict[str, list[int]] = field(default_factory=dict)
    versions: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    telemetry: int = 0
    offline_seen: bool = False

    def record(self, stream: str, index: int, version: str) -> None:
        self.indices.setdefault(stream, []).append(index)
        seen = self.versions.setdefault(stream, [])
        if not seen or seen[-1][1] != version:
            seen.append((index, version))

    def gaps(self, stream: str) -> tuple[int, int]:
        """(frames missing, frames duplicated) between the first and last index seen."""
        got = self.indices.get(stream, [])
        if not got:
            return (0, 0)
        unique = set(got)
        return (max(got) - min(got) + 1 - len(unique), len(got) - len(unique))


def _describe(payload: dict[str, Any]) -> str:
    if payload.get("classes"):
        top = payload["classes"][0]
        return f"top: {top['label']} ({top['score']:.2f})"
    if payload.get("detections") is not None:
        dets = payload["detections"]
        first = f", e.g. {dets[0]['label']} {dets[0]['score']:.2f}" if dets else ""
        return f"{len(dets)} objects{first}"
    return "tensors"


def _print_telemetry(values: dict[str, Any]) -> None:
    parts = []
    for stream in ("lobby", "gate"):
        fps = values.get(f"stream.{stream}.fps")
        p50 = values.get(f"stream.{stream}.latency.total.p50_ms")
        p99 = values.get(f"stream.{stream}.latency.total.p99_ms")
        if fps is not None:
            parts.append(f"{stream} {fps:.1f} fps p50 {p50 or 0:.0f} ms p99 {p99 or 0:.0f} ms")
    cpu, rss = values.get("process.cpu_percent"), values.get("process.rss_mb")
    if cpu is not None and rss is not None:
        parts.append(f"cpu {cpu:.0f}% rss {rss:.0f} MB")
    print(f"  telemetry  {' | '.join(parts)}", flush=True)


def run_demo(duration: float | None = 30.0, workdir: Path | None = None) -> int:
    """Run the demo; ``duration=None`` runs until Ctrl-C. Returns the exit code."""
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="edge-agent-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"edge-agent demo: files in {workdir}")
    v1 = write_classifier(workdir / "classifier-v1.onnx", input_size=64, num_classes=5, seed=1)
    v2 = write_classifier(workdir / "classifier-v2.onnx", input_size=64, num_classes=5, seed=2)
    detector = write_detector(workdir / "detector.onnx", input_size=320, num_classes=3, seed=0)
    video = write_demo_video(workdir / "lobby.avi")
    print("  wrote classifier v1 and v2, a detector and a 640x480 video")

    with Broker(workdir / "broker") as broker:
        print(f"  mosquitto listening on 127.0.0.1:{broker.port}")
        files = DemoFiles(workdir, broker.port, v1, v2, detector, video)
        config_path = files.config_path
        config_path.write_text(yaml.safe_dump(demo_config(files, v1, "1")))
        observer = Observer(
            MqttSettings(host="127.0.0.1", port=broker.port), [f"{PREFIX}/{DEVICE}/up/#"]
        ).start()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        daemon = subprocess.Popen([sys.executable, "-m", "agent", "run", "-c", str(config_path)], env=env)
        print(f"  started the agent daemon (pid {daemon.pid})\n")
        ledger = DemoLedger()
        try:
            _watch(observer, ledger, daemon, files, duration)
        except KeyboardInterrupt:
            print("\n  Ctrl-C")
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=20)
            _drain(observer, ledger, 2.0)
            observer.stop()
    return _verdict(ledger, code)


def _watch(
    observer: Observer,
    ledger: DemoLedger,
    daemon: subprocess.Popen[bytes],
    files: DemoFiles,
    duration: float | None,
) -> None:
    start = time.monotonic()
    swap_at = (duration or 30.0) * 0.45
    swapped = False
    last_print: dict[str, float] = {}
    while duration is None or time.monotonic() - start < duration:
        if daemon.poll() is not None:
            print(f"  the agent exited early with code {daemon.returncode}")
            return
        if not swapped and time.monotonic() - start > swap_at:
            files.config_path.write_text(yaml.safe_dump(demo_config(files, files.v2, "2")))
            daemon.send_signal(signal.SIGHUP)
            swapped = True
            print("\n  >>> rewrote the config to classifier v2 and sent SIGHUP (hot-swap)\n", flush=True)
        _drain(observer, ledger, 0.2, last_print, start)


def _drain(
    observer: Observer,
    ledger: DemoLedger,
    seconds: float,
    last_print: dict[str, float] | None = None,
    start: float = 0.0,
) -> None:
    until = time.monotonic() + seconds
    while (remaining := until - time.monotonic()) > 0:
        arrival = observer.get(remaining)
        if arrival is None:
            return
        topic, raw, _retained = arrival
        kind = topic.split("/up/", 1)[1]
        payload = json.loads(raw)
        if kind.startswith("results/"):
            stream = kind.split("/", 1)[1]
            version = payload["model"].get("version") or "-"
            ledger.record(stream, payload["frame_index"], version)
            if last_print is not None and time.monotonic() - last_print.get(stream, 0.0) > 1.0:
                last_print[stream] = time.monotonic()
                print(
                    f"  [{time.monotonic() - start:5.1f}s] {stream:<6} frame {payload['frame_index']:>5}  "
                    f"{payload['model']['model_id']} v{version}  {_describe(payload)}  "
                    f"{payload['latency_ms']['total']:.1f} ms",
                    flush=True,
                )
        elif kind == "telemetry":
            ledger.telemetry += 1
            _print_telemetry(payload)
        elif kind == "status":
            print(f"  status     {payload['state']} (session {payload['session']})", flush=True)
            ledger.offline_seen = payload["state"] == "offline"


def _verdict(ledger: DemoLedger, code: int) -> int:
    print("\n  summary")
    ok = code == 0
    print(f"    agent exit code          {code}")
    for stream, indices in sorted(ledger.indices.items()):
        missing, dupes = ledger.gaps(stream)
        print(f"    {stream:<6} results          {len(indices)} (frames {min(indices)}..{max(indices)})")
        history = " -> ".join(f"v{v} from frame {i}" for i, v in ledger.versions[stream])
        print(f"    {stream:<6} model versions   {history}")
        if stream == "lobby":
            print(f"    lobby frames lost        {missing} (duplicates {dupes})")
            ok = ok and missing == 0 and dupes == 0 and len(ledger.versions[stream]) >= 2
    print(f"    telemetry messages       {ledger.telemetry}")
    print(f"    offline status at exit   {'yes' if ledger.offline_seen else 'no'}")
    ok = ok and bool(ledger.indices) and ledger.offline_seen
    print(f"\n  demo {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1
