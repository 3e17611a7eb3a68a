"""The real daemon as a subprocess, with its config, models and video written into a temp dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from agent.demo.modelzoo import write_classifier
from agent.demo.setup import write_demo_video
from agent.protocol.messages import ResultMessage, decode
from tests.mqtt_probe import Received
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[2]


def unique_results(messages: list[Received], topic: str) -> list[ResultMessage]:
    """Results on ``topic`` by frame index, duplicates (same msg_id: a QoS 1 resend) removed."""
    seen: dict[str, ResultMessage] = {}
    for m in messages:
        if m.topic == topic:
            result = decode(ResultMessage, m.payload)
            seen.setdefault(result.msg_id, result)
    return sorted(seen.values(), key=lambda r: r.frame_index)


#: A camera source that never answers (the discard port), replacing a file source: the file
#: source's own keys are removed (null), since an overlay's maps merge key by key.
UNREACHABLE_URL_SOURCE: dict[str, object] = {
    "type": "url",
    "url": "http://127.0.0.1:9/nothing",
    "path": None,
    "loop": None,
    "realtime": None,
}


class AgentFiles:
    """Models v1/v2, a short video and a config for one device id, all under ``root``."""

    def __init__(self, root: Path, port: int, device_id: str, frames: int = 60) -> None:
        self.root = root
        self.port = port
        self.device_id = device_id
        root.mkdir(parents=True, exist_ok=True)
        self.v1 = write_classifier(root / "cls-v1.onnx", input_size=32, num_classes=4, seed=1)
        self.v2 = write_classifier(root / "cls-v2.onnx", input_size=32, num_classes=4, seed=2)
        self.frames = frames
        self.video = write_demo_video(root / "cam.avi", frames=frames, size=(160, 120), fps=30.0)
        self.config_path = root / "agent.yaml"

    def write_config(self, *, model: Path | None = None, version: str = "1", **overrides: Any) -> Path:
        """agent.yaml with one slot ``cls`` and one stream ``cam``: ``stream=`` and ``slot=`` are merged
        into those two, any other keyword into the top level (a dict one level deep)."""
        stream: dict[str, Any] = {
            "source": {"type": "file", "path": str(self.video), "loop": False, "realtime": True},
            "slot": "cls",
            "drop_policy": "process_all",
            "results_qos": 1,
        }
        stream.update(overrides.pop("stream", {}))
        slot: dict[str, Any] = {
            "model": str(model or self.v1),
            "model_id": "cls",
            "version": version,
            "preprocess": {"width": 32, "height": 32},
            "postprocess": {"type": "classification", "top_k": 2},
        }
        slot.update(overrides.pop("slot", {}))
        config: dict[str, Any] = {
            "device_id": self.device_id,
            "state_dir": str(self.root / "state"),
            "mqtt": {"host": "127.0.0.1", "port": self.port, "reconnect_min_s": 0.5, "reconnect_max_s": 2.0},
            "slots": {"cls": slot},
            "streams": {"cam": stream},
            "telemetry": {"interval_s": 1.0},
            "logging": {"format": "json", "level": "info"},
        }
        for key, value in overrides.items():
            config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
        self.config_path.write_text(yaml.safe_dump(config))
        return self.config_path


class Daemon:
    """``python -m agent run -c CONFIG`` with its output captured to a log file."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "-c", str(config)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(patient(timeout))
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(patient(10))
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines."""
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_for_event(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + patient(timeout)
        while time.monotonic() < deadline:
            for entry in self.events():
                if entry.get("event") == event:
                    return entry
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise TimeoutError(f"no {event!r} in the daemon log:\n{self.log()[-3000:]}")
