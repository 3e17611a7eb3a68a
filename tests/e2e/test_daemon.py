"""End to end: the real daemon process, a real mosquitto, a real video file, real signals."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.protocol.messages import InfoMessage, ResultMessage, StatusMessage, decode
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe

pytestmark = pytest.mark.slow


def _indices(results: list[ResultMessage]) -> list[int]:
    return [r.frame_index for r in results]


def test_every_frame_one_result_then_clean_exit(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=45)
    daemon = Daemon(files.write_config(), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= files.frames, timeout=60)
        info = [m for m in probe.snapshot() if m.topic.endswith("/up/info")]
        telemetry = probe.wait_for_count(f"fleet/v1/{device_id}/up/telemetry", 1, timeout=10)
    finally:
        code = daemon.stop(timeout=10)  # the unit's contract: SIGTERM to exit within 10 s
    assert code == 0, daemon.log()[-2000:]
    results = unique_results(probe.snapshot(), topic)
    assert _indices(results) == list(range(files.frames))
    first = results[0]
    assert first.model.model_id == "cls"
    assert first.model.version == "1"
    assert len(first.model.sha256) == 64
    assert first.classes is not None
    assert len(first.classes) == 2
    assert set(first.latency_ms) >= {"preprocess", "infer", "postprocess", "total"}
    assert first.published_at >= first.captured_at
    # Retained info names the active model; telemetry is flat numeric JSON.
    assert info
    slot = decode(InfoMessage, info[-1].payload).slots["cls"]
    assert slot.model is not None
    # The file is paced at its frame rate like a camera: the latency layout, one worker.
    assert slot.workers == 1
    assert slot.layout is not None
    assert slot.layout.startswith("auto: a live or paced stream")
    values = json.loads(telemetry[0].payload)
    assert all(isinstance(v, (int, float)) for v in values.values())
    assert values["stream.cam.frames_captured"] >= 1
    # The last status is a retained 'offline', and a new subscriber gets it.
    with Probe(broker.host, broker.port) as late:
        late.subscribe(f"fleet/v1/{device_id}/up/status")
        status = late.wait_for_count(f"fleet/v1/{device_id}/up/status", 1, timeout=5)[0]
    assert status.retain
    assert decode(StatusMessage, status.payload).state == "offline"


def test_sighup_hot_swap_loses_no_frame(tmp_path: Path, broker: Broker, device_id: str, probe: Probe) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 20, timeout=60)
        files.write_config(model=files.v2, version="2", stream=stream)
        daemon.signal(signal.SIGHUP)
        probe.wait_for(
            lambda ms: sum(r.model.version == "2" for r in unique_results(ms, topic)) >= 20, timeout=60
        )
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-2000:]
    results = unique_results(probe.snapshot(), topic)
    indices = _indices(results)
    assert indices == list(range(len(indices))), "a frame index is missing or repeated"
    versions = [r.model.version for r in results]
    switch = versions.index("2")
    assert set(versions[:switch]) == {"1"}
    assert set(versions[switch:]) == {"2"}
    assert results[switch].model.sha256 != results[0].model.sha256


def test_bad_model_on_reload_keeps_old_one_serving(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(files.v2.read_bytes()[:200])  # truncated ONNX
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 10, timeout=60)
        files.write_config(model=broken, version="2", stream=stream)
        daemon.signal(signal.SIGHUP)
        failure = daemon.wait_for_event("slot.swap.rejected")
        count = len(unique_results(probe.snapshot(), topic))
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= count + 15, timeout=30)
    finally:
        code = daemon.stop()
    assert code == 0
    assert "broken.onnx" in failure["error"]
    results = unique_results(probe.snapshot(), topic)
    assert {r.model.version for r in results} == {"1"}
    assert _indices(results) == list(range(len(results)))
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["version"] == "1"


def test_invalid_config_on_reload_changes_nothing(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 5, timeout=60)
        files.config_path.write_text(files.config_path.read_text() + "\nbogus_key: 1\n")
        daemon.signal(signal.SIGHUP)
        event = daemon.wait_for_event("config.reload.invalid")
        count = len(unique_results(probe.snapshot(), topic))
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= count + 10, timeout=30)
    finally:
        code = daemon.stop()
    assert code == 0
    assert any("bogus_key" in p for p in event["problems"])


def test_broker_restart_loses_no_durable_result(
    tmp_path: Path, broker_factory: object, device_id: str
) -> None:
    persist = tmp_path / "mosquitto-db"
    persist.mkdir()
    broker = broker_factory(  # type: ignore[operator]
        ["persistence true", f"persistence_location {persist}/", "autosave_interval 1"]
    )
    files = AgentFiles(tmp_path / "agent", broker.port, device_id, frames=90)
    config = files.write_config(stream={"durable_results": True})
    topic = f"fleet/v1/{device_id}/up/results/cam"
    # A persistent session: the broker keeps the subscription and queues for it across its restart.
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device_id}", session_expiry_s=600)
    probe.subscribe(topic)
    daemon = Daemon(config, tmp_path / "agent.log")
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 15, timeout=60)
        broker.stop()
        time.sleep(1.5)  # the agent keeps producing; its results go to the spool
        broker.start()
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= files.frames, timeout=60)
    finally:
        code = daemon.stop()
        probe.close()
    assert code == 0, daemon.log()[-2000:]
    received = [m for m in probe.snapshot() if m.topic == topic]
    results = unique_results(received, topic)
    assert _indices(results) == list(range(files.frames))
    assert len(received) >= len(results)  # duplicates are allowed; dedupe by msg_id leaves exactly one each


def test_restart_comes_back_on_last_known_good(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    """The configured model is gone after a restart: the agent serves the model state.json recorded."""
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    copy = tmp_path / "deployed-v2.onnx"
    copy.write_bytes(files.v2.read_bytes())
    daemon = Daemon(files.write_config(model=copy, version="2", stream=stream), tmp_path / "agent-1.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 3, timeout=60)
    finally:
        assert daemon.stop() == 0
    files.write_config(model=tmp_path / "missing.onnx", version="3", stream=stream)
    probe.clear()
    daemon = Daemon(files.config_path, tmp_path / "agent-2.log")
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 3, timeout=60)
    finally:
        assert daemon.stop() == 0
    versions = {r.model.version for r in unique_results(probe.snapshot(), topic)}
    assert versions == {"2"}
