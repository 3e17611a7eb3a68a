"""End to end: the real daemon reading real RTSP cameras (gst-rtsp-server on loopback).

One camera reboots while the other (H.265, with credentials) never stops, and a third stream with
a wrong password to that camera only fails, saying why; snapshots and shadow
evidence frames are frames the RTSP camera sent, read back from the counter burnt into them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import yaml

from agent.camera.source import STATE_CODES, SourceState
from agent.demo.broker import Broker
from agent.fleet.devices.evidence import fetch_evidence
from agent.fleet.devices.snapshot import take_snapshot
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState
from agent.protocol.proving import ShadowSpec
from agent.protocol.topics import Topics
from tests.camera.rtsp_camera import RtspCamera, read_marks, rtsp_server_missing
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.e2e.fleet_rig import Fleet, count_version, final_status, finish, operator_settings
from tests.mqtt_probe import Probe, Received
from tests.runtime.models import write_swapped_classes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(rtsp_server_missing()), reason=str(rtsp_server_missing())),
]

STREAMING = float(STATE_CODES[SourceState.STREAMING])
RECONNECTING = float(STATE_CODES[SourceState.RECONNECTING])


def _rtsp(url: str) -> dict[str, Any]:
    return {"type": "url", "url": url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0}


def _telemetry(messages: list[Received], topics: Topics) -> list[dict[str, float]]:
    return [json.loads(m.payload) for m in messages if m.topic == topics.telemetry]


def _image(jpeg: bytes) -> Any:
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None, "not a JPEG"
    return image


def test_a_camera_reboot_is_a_gap_in_one_stream_while_the_other_serves_and_snapshots(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    rebooting = RtspCamera().start()
    locked = RtspCamera(codec="h265", user="viewer").start()
    files = AgentFiles(tmp_path, broker.port, device_id, frames=10)
    config = files.write_config(stream={"source": _rtsp(rebooting.url), "drop_policy": "keep_newest"})
    config_doc = yaml.safe_load(config.read_text())
    config_doc["streams"]["locked"] = {**config_doc["streams"]["cam"], "source": _rtsp(locked.url)}
    wrong_password = locked.password[::-1]
    config_doc["streams"]["refused"] = {
        **config_doc["streams"]["cam"],
        "source": _rtsp(locked.url_as("viewer", wrong_password)),
    }
    config.write_text(yaml.safe_dump(config_doc))
    topics = Topics("fleet/v1", device_id)
    daemon = Daemon(config, tmp_path / "agent.log")
    try:
        cam, other = topics.results("cam"), topics.results("locked")
        probe.wait_for(
            lambda ms: len(unique_results(ms, cam)) >= 5 and len(unique_results(ms, other)) >= 5, timeout=60
        )

        rebooting.stop()
        probe.wait_for(
            lambda ms: any(t.get("stream.cam.source.state") == RECONNECTING for t in _telemetry(ms, topics))
        )
        during = len(unique_results(probe.snapshot(), other))
        probe.wait_for(lambda ms: len(unique_results(ms, other)) >= during + 10)  # the other one serves
        rebooting.start()
        probe.wait_for(
            lambda ms: any(t.get("stream.cam.source.gaps", 0) >= 1 for t in _telemetry(ms, topics))
        )
        resumed = len(unique_results(probe.snapshot(), cam))
        probe.wait_for(lambda ms: len(unique_results(ms, cam)) >= resumed + 5)

        snapshot = take_snapshot(MqttSettings(host=broker.host, port=broker.port), device_id, stream="locked")
    finally:
        code = daemon.stop()
        rebooting.stop()
        locked.stop()
    assert code == 0, daemon.log()[-3000:]

    seen = probe.snapshot()
    indices = [r.frame_index for r in unique_results(seen, topics.results("cam"))]
    assert indices == sorted(indices)
    gaps = [e for e in daemon.events() if e.get("event") == "camera.source.gap"]
    assert [g["stream"] for g in gaps] == ["cam"]
    assert gaps[0]["frames_missed"] >= 1
    last = _telemetry(seen, topics)[-1]
    assert last["stream.cam.source.state"] == STREAMING
    assert last["stream.locked.source.state"] == STREAMING
    assert last["stream.locked.source.reconnects"] == 0
    assert last["stream.cam.source.frames_missed"] >= gaps[0]["frames_missed"]

    # The snapshot is a frame the H.265 camera sent: its burnt-in counter reads back whole.
    assert snapshot.meta["stream"] == "locked"
    marks = read_marks(_image(snapshot.jpeg))
    assert marks.intact
    assert marks.counter > 0
    # A refused password says so, and no password reaches the log.
    assert last["stream.refused.source.open_failures"] >= 1
    assert last["stream.refused.source.frames"] == 0
    refused = [
        e for e in daemon.events() if e.get("event") == "camera.source.failed" and e["stream"] == "refused"
    ]
    assert all("refused the credentials (401 Unauthorized)" in e["reason"] for e in refused)
    assert locked.password not in daemon.log()
    assert wrong_password not in daemon.log()


def test_shadow_evidence_frames_come_from_the_rtsp_camera(
    fleet: Fleet, device_id: str, probe: Probe, tmp_path: Path
) -> None:
    camera = RtspCamera().start()
    try:
        files = fleet.files(device_id)
        trust = {"trusted_keys": {fleet.keys.key_id: str(fleet.keys.public)}}
        files.write_config(stream={"source": _rtsp(camera.url), "drop_policy": "keep_newest"}, delivery=trust)
        daemon = fleet.start(files)
        probe.wait_for(count_version("1", Topics("fleet/v1", device_id).results("cam")), timeout=60)
        swapped = write_swapped_classes(files.v1, files.root / "swapped.onnx")
        # Shadow on, as operators run it: here it is what rejects the class-swapped model.
        job = fleet.deploy(swapped, [device_id], "2", shadow=ShadowSpec(frames=20, sample_fps=10.0))
        outcome = finish(job)
        final = final_status(probe, job.job_id, device_id)
        evidence = fetch_evidence(operator_settings(fleet.broker), device_id, job.job_id)
        assert daemon.stop() == 0
    finally:
        camera.stop()
    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "shadow_disagrees"), progress
    assert final.evidence is not None
    assert evidence.frames
    counters = []
    for frame in evidence.frames:
        marks = read_marks(_image(frame.jpeg))
        assert marks.intact
        counters.append(marks.counter)
    assert len(set(counters)) == len(counters)  # distinct frames of the camera
