"""End to end: samples for retraining from the real daemon on a real video to a real controller.

The agent runs (``python -m agent run``) with ``samples`` turned on for its classifier slot and a bar
every frame is under, at 3 a minute: exactly 3 samples arrive however many frames play, each the JPEG
of the video frame it names with the very classes the device published for that frame; the
controller keeps them; ``fleet samples export --format folders`` writes them as a class-folder tree
that is read back. With the defaults (sampling off) the same daemon publishes none.
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.process import FleetController
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import decode
from agent.protocol.samples import SampleMessage
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PER_MINUTE = 3


def _with_samples(files: AgentFiles, prefix: str, samples: dict[str, object] | None) -> Path:
    return files.write_config(mqtt={"prefix": prefix}, slot={} if samples is None else {"samples": samples})


def _video_frames(path: Path) -> list[np.ndarray]:
    capture = cv2.VideoCapture(str(path))
    frames: list[np.ndarray] = []
    while True:
        ok, image = capture.read()
        if not ok:
            return frames
        frames.append(image)


def test_samples_flow_from_the_daemon_to_the_controller_and_export(
    tmp_path: Path, broker: Broker, device_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}/v1"
    files = AgentFiles(tmp_path, broker.port, device_id, frames=40)
    # Every frame is a sample (a top-1 score is below 1.0): only the rate decides how many go.
    config = _with_samples(files, prefix, {"enabled": True, "max_confidence": 1.0, "per_minute": PER_MINUTE})
    controller = FleetController(
        ControllerConfig(
            mqtt=MqttSettings(host=broker.host, port=broker.port, prefix=prefix),
            state_dir=tmp_path / "controller",
            unsigned=True,
        )
    ).start()
    probe = Probe(broker.host, broker.port)
    probe.subscribe(f"{prefix}/{device_id}/up/#")
    daemon = Daemon(config, tmp_path / "agent.log")
    results_topic = f"{prefix}/{device_id}/up/results/cam"
    samples_topic = f"{prefix}/{device_id}/up/samples"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, results_topic)) >= files.frames, timeout=60)
        assert controller.samples is not None
        store = controller.samples
        wait_until(lambda: len(store.samples()) == PER_MINUTE, 30, "the samples in the controller's store")
        # Give the device the rest of the video's results in flight; the rate allows no more.
        probe.wait_for(lambda ms: sum(m.topic == samples_topic for m in ms) >= PER_MINUTE, timeout=30)
    finally:
        assert daemon.stop() == 0
        probe.close()
        controller.stop()

    sent = [decode(SampleMessage, m.payload) for m in probe.snapshot() if m.topic == samples_topic]
    assert len({s.msg_id for s in sent}) == PER_MINUTE
    results = {r.frame_index: r for r in unique_results(probe.snapshot(), results_topic)}
    video = _video_frames(files.video)
    for sample in sent:
        assert sample.prediction.classes == results[sample.frame].classes
        assert sample.reason == "low_confidence"
        jpeg = cv2.imdecode(np.frombuffer(base64.b64decode(sample.jpeg_b64), np.uint8), cv2.IMREAD_COLOR)
        assert jpeg is not None
        assert jpeg.shape[:2] == (sample.height, sample.width) == video[sample.frame].shape[:2]
        assert float(np.abs(jpeg.astype(np.float32) - video[sample.frame].astype(np.float32)).mean()) < 8.0

    out = tmp_path / "dataset"
    argv = ["fleet", "samples", "export", "--format", "folders", "--state-dir", str(tmp_path / "controller")]
    capsys.readouterr()  # the controller's log lines
    assert main([*argv, "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == PER_MINUTE
    exported = sorted(out.glob("*/*.jpg"))
    assert len(exported) == PER_MINUTE
    labels = {s.prediction.classes[0].label for s in sent if s.prediction.classes}
    assert {p.parent.name for p in exported} == labels
    assert all(cv2.imread(str(p)) is not None for p in exported)


def test_with_the_defaults_the_daemon_sends_no_sample(tmp_path: Path, broker: Broker, device_id: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}/v1"
    files = AgentFiles(tmp_path, broker.port, device_id, frames=20)
    probe = Probe(broker.host, broker.port)
    probe.subscribe(f"{prefix}/{device_id}/up/#")
    daemon = Daemon(_with_samples(files, prefix, None), tmp_path / "agent.log")
    results_topic = f"{prefix}/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, results_topic)) >= files.frames, timeout=60)
    finally:
        assert daemon.stop() == 0
        probe.close()
    assert not [m for m in probe.snapshot() if m.topic.endswith("/up/samples")]
