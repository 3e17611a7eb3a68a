"""A running stream's fps limit, rotation and region of interest change with a reload (SIGHUP), and
only that stream changes: its source stays open, and the other stream's frames never stop. A real
daemon, a real broker, the real ``snapshot`` command to see the framed picture."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.demo.broker import Broker
from agent.fleet.devices.snapshot import take_snapshot
from agent.mqtt.settings import MqttSettings
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

pytestmark = pytest.mark.slow

#: The synthetic door camera's frame size.
DOOR_W, DOOR_H = 64, 48


def _config(files: AgentFiles, **door: Any) -> Path:
    cam = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    door_stream = {
        "source": {"type": "synthetic", "width": DOOR_W, "height": DOOR_H, "fps": 20},
        "slot": "cls",
    }
    return files.write_config(stream=cam, streams={"door": {**door_stream, **door}})


def _size(jpeg: bytes) -> tuple[int, int]:
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None
    return image.shape[1], image.shape[0]


def _telemetry(messages: list[Received], device_id: str) -> list[dict[str, float]]:
    return [json.loads(m.payload) for m in messages if m.topic == f"fleet/v1/{device_id}/up/telemetry"]


def test_a_reload_retunes_one_stream_and_the_other_streams_frames_never_stop(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    daemon = Daemon(_config(files), tmp_path / "agent.log")
    cam = f"fleet/v1/{device_id}/up/results/cam"
    door = f"fleet/v1/{device_id}/up/results/door"
    settings = MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.2, reconnect_max_s=1.0)
    try:
        probe.wait_for(
            lambda ms: len(unique_results(ms, cam)) >= 5 and len(unique_results(ms, door)) >= 5, timeout=60
        )
        before = take_snapshot(settings, device_id, stream="door", timeout=patient(20))
        _config(files, rotate=90, roi={"x": 0.0, "y": 0.0, "width": 0.5, "height": 1.0}, fps_limit=2)
        daemon.signal(signal.SIGHUP)
        applied = daemon.wait_for_event("config.reload.applied")
        cam_at_reload = len(unique_results(probe.snapshot(), cam))
        # Frames of both streams after the reload, and door's fps limit at work in its telemetry.
        probe.wait_for(
            lambda ms: (
                len(unique_results(ms, cam)) >= cam_at_reload + 30
                and any(t.get("stream.door.dropped.fps_limit", 0) > 0 for t in _telemetry(ms, device_id))
            ),
            timeout=60,
        )
        after = take_snapshot(settings, device_id, stream="door", timeout=patient(20))
        seen = probe.snapshot()
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]

    assert applied["retuned"] == ["door"]
    assert not [key for key in applied["restart_required"] if key.startswith("streams.")]
    assert set(applied["changed"]) == {
        "streams.door.fps_limit",
        "streams.door.rotate",
        "streams.door.roi",
    } | {f"streams.door.roi.{k}" for k in ("x", "y", "width", "height")}
    # door: turned a quarter clockwise (48 x 64), then its left half kept (24 x 64).
    assert _size(before.jpeg) == (DOOR_W, DOOR_H)
    assert _size(after.jpeg) == (DOOR_H // 2, DOOR_W)
    # cam: every frame of the looping file published, before, across and after the reload.
    indices = sorted(r.frame_index for r in unique_results(seen, cam))
    assert indices == list(range(indices[0], indices[-1] + 1))
    assert indices[-1] - indices[0] >= cam_at_reload + 29
    # Neither stream's source was reopened: one connect, one first frame, no reconnect.
    states = [e for e in daemon.events() if e.get("event") == "camera.source.state"]
    for stream in ("cam", "door"):
        assert [e["new"] for e in states if e["stream"] == stream][:2] == ["connecting", "streaming"]
        assert "reconnecting" not in {e["new"] for e in states if e["stream"] == stream}
    retuned = [e for e in daemon.events() if e.get("event") == "stream.retuned"]
    assert [(e["stream"], e["rotate"], e["fps_limit"]) for e in retuned] == [("door", 90, 2.0)]
