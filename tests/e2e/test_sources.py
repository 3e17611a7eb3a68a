"""Every camera source type at once in the real daemon: file, synthetic, GStreamer, HTTP MJPEG, V4L2.

There is no camera on this machine: the V4L2 stream points at a missing device and must show up
in telemetry as reconnecting while the other four streams keep producing results. A network camera
whose URL carries a password (made at run time) and points at a closed port shows in ``up/info``
as reconnecting with its reason, the password stripped.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.camera.source import STATE_CODES, SourceState
from agent.demo.broker import Broker
from agent.protocol.messages import InfoMessage, ResultMessage, decode
from tests.camera.mjpeg_server import MjpegServer
from tests.e2e.daemon import AgentFiles, Daemon
from tests.mqtt_probe import Probe, Received

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("gst-launch-1.0") is None, reason="gst-launch-1.0 missing: run `make os-deps`"
    ),
]

MISSING_DEVICE = "/dev/video99"
WORKING = ("file", "synthetic", "gst", "ipcam")
CAPS = "video/x-raw,format=BGR,width=64,height=48,framerate=20/1"


@pytest.fixture
def camera() -> Iterator[MjpegServer]:
    server = MjpegServer(width=64, height=48, fps=20.0).start()
    yield server
    server.stop()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _config(files: AgentFiles, camera_url: str, locked_url: str) -> dict[str, Any]:
    streams: dict[str, Any] = {
        "file": {"type": "file", "path": str(files.video), "loop": True, "realtime": True},
        "synthetic": {"type": "synthetic", "width": 64, "height": 48, "fps": 20},
        "gst": {
            "type": "gstreamer",
            "pipeline": "videotestsrc is-live=true ! " + CAPS,
            "width": 64,
            "height": 48,
        },
        "ipcam": {"type": "url", "url": camera_url},
        "usb": {"type": "v4l2", "device": MISSING_DEVICE, "reconnect_min_s": 0.5, "reconnect_max_s": 1.0},
        "locked": {"type": "url", "url": locked_url, "reconnect_min_s": 0.5, "reconnect_max_s": 1.0},
    }
    return {
        "device_id": files.device_id,
        "state_dir": str(files.root / "state"),
        "mqtt": {"host": "127.0.0.1", "port": files.port},
        "slots": {
            "cls": {
                "model": str(files.v1),
                "model_id": "cls",
                "version": "1",
                "preprocess": {"width": 32, "height": 32},
                "postprocess": {"type": "classification", "top_k": 1},
            }
        },
        "streams": {name: {"source": source, "slot": "cls"} for name, source in streams.items()},
        "telemetry": {"interval_s": 0.5},
        "logging": {"format": "json", "level": "info"},
    }


def _result_counts(messages: list[Received], device: str) -> dict[str, int]:
    counts = dict.fromkeys((*WORKING, "usb", "locked"), 0)
    prefix = f"fleet/v1/{device}/up/results/"
    for m in messages:
        if m.topic.startswith(prefix):
            counts[decode(ResultMessage, m.payload).stream] += 1
    return counts


def _telemetry(messages: list[Received], device: str) -> list[dict[str, float]]:
    return [json.loads(m.payload) for m in messages if m.topic == f"fleet/v1/{device}/up/telemetry"]


def _infos(messages: list[Received], device: str) -> list[InfoMessage]:
    return [decode(InfoMessage, m.payload) for m in messages if m.topic == f"fleet/v1/{device}/up/info"]


def _cameras_reported(info: InfoMessage) -> bool:
    """The working streams streaming and the locked camera's failure, in one up/info."""
    locked = info.cameras.get("locked")
    working = all(name in info.cameras and info.cameras[name].state == "streaming" for name in WORKING)
    return working and locked is not None and locked.last_error is not None


def test_every_source_type_in_one_daemon(tmp_path: Path, broker: Broker, camera: MjpegServer) -> None:
    if Path(MISSING_DEVICE).exists():
        pytest.skip(f"{MISSING_DEVICE} exists on this machine")
    device = f"src-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path, broker.port, device, frames=30)
    password = secrets.token_hex(8)
    locked_url = f"http://viewer:{password}@127.0.0.1:{_closed_port()}/stream.mjpg"
    files.config_path.write_text(yaml.safe_dump(_config(files, camera.url, locked_url)))
    reconnecting = float(STATE_CODES[SourceState.RECONNECTING])
    streaming = float(STATE_CODES[SourceState.STREAMING])

    def settled(messages: list[Received]) -> bool:
        counts = _result_counts(messages, device)
        usb_seen = any(t.get("stream.usb.source.state") == reconnecting for t in _telemetry(messages, device))
        infos = _infos(messages, device)
        infos_ok = bool(infos) and _cameras_reported(infos[-1])
        return usb_seen and infos_ok and all(counts[name] >= 5 for name in WORKING)

    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        daemon = Daemon(files.config_path, tmp_path / "agent.log")
        try:
            probe.wait_for(settled, timeout=60)
            seen = probe.snapshot()
        finally:
            code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]

    counts = _result_counts(seen, device)
    assert counts["usb"] == 0
    assert all(counts[name] >= 5 for name in WORKING), counts
    telemetry = _telemetry(seen, device)
    usb_states = {t["stream.usb.source.state"] for t in telemetry if "stream.usb.source.state" in t}
    assert streaming not in usb_states
    last = telemetry[-1]
    assert last["stream.usb.source.open_failures"] >= 1
    assert last["stream.usb.source.reconnects"] >= 1
    assert last["stream.usb.source.frames"] == 0
    for name in WORKING:
        assert last[f"stream.{name}.source.state"] == streaming, name
        assert last[f"stream.{name}.source.frames"] >= 1, name
    failures = [e for e in daemon.events() if e.get("event") == "camera.source.failed"]
    usb_failures = [e for e in failures if e["stream"] == "usb"]
    assert usb_failures
    assert f"camera device {MISSING_DEVICE} does not exist" in usb_failures[0]["reason"]
    # Per camera in telemetry: what it delivers and how long since its last frame.
    for name in WORKING:
        assert last[f"stream.{name}.capture_fps"] >= 0, name
        assert 0 <= last[f"stream.{name}.source.last_frame_age_s"] < 5, name
    assert last["stream.usb.source.last_frame_age_s"] > 0
    # Per camera in up/info: state, counters, the last failure without the password.
    info = _infos(seen, device)[-1]
    locked = info.cameras["locked"]
    assert locked.state in {"reconnecting", "connecting"}
    assert locked.reconnects >= 1
    assert locked.frames == 0
    assert locked.last_error is not None
    assert "//***@127.0.0.1" in locked.last_error
    assert password not in locked.last_error
    assert all(password not in m.payload.decode("utf-8", "replace") for m in seen)
    assert password not in daemon.log()
    assert all(info.cameras[name].state == "streaming" for name in WORKING)
    assert info.cameras["usb"].last_error is not None
    assert MISSING_DEVICE in info.cameras["usb"].last_error
