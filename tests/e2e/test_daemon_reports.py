"""The daemon says what it does: an empty slot says why, a reload says what changed, a rollback
says when there is nothing older to go back to. A real daemon, a real broker, real signals."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.fleet.devices.command import send_command
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import InfoMessage, SlotInfo, decode
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe, Received
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _slot_info(messages: list[Received], device_id: str) -> SlotInfo | None:
    infos = [m for m in messages if m.topic == f"fleet/v1/{device_id}/up/info"]
    return decode(InfoMessage, infos[-1].payload).slots["cls"] if infos else None


def _events(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    return [e for e in daemon.events() if e.get("event") == name]


def _looping(files: AgentFiles) -> dict[str, object]:
    return {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}


def test_a_missing_model_file_is_said_once_at_start_and_in_up_info_until_a_reload_fills_the_slot(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    missing = tmp_path / "models" / "cls.onnx"
    daemon = Daemon(files.write_config(model=missing, stream=_looping(files)), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        started = daemon.wait_for_event("agent.started", timeout=60)
        empty = probe.wait_for(lambda ms: _slot_info(ms, device_id) is not None, timeout=20)
        info = _slot_info(empty, device_id)
        # The file appears and the operator reloads: the slot fills without a restart.
        missing.parent.mkdir()
        missing.write_bytes(files.v1.read_bytes())
        daemon.signal(signal.SIGHUP)
        applied = daemon.wait_for_event("config.reload.applied")
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 3, timeout=60)
        filled = probe.wait_for(
            lambda ms: (s := _slot_info(ms, device_id)) is not None and s.model is not None, timeout=20
        )
    finally:
        assert daemon.stop() == 0
    warnings = _events(daemon, "agent.slot.empty")
    assert len(warnings) == 1, "one loud line at start, not one per frame"
    assert warnings[0]["level"] == "warning"
    assert warnings[0]["slot"] == "cls"
    assert warnings[0]["reason"] == f"model file {missing} not found"
    assert "reload" in warnings[0]["fix"]
    assert started["empty_slots"] == ["cls"]
    assert info is not None
    assert (info.state, info.model, info.reason) == ("empty", None, f"model file {missing} not found")
    assert applied["swapping"] == ["cls"]  # same path, now a file: the empty slot is loaded
    after = _slot_info(filled, device_id)
    assert after is not None
    assert (after.state, after.reason) == ("active", None)


def test_a_reload_logs_each_changed_key_and_what_waits_for_a_restart_without_printing_secrets(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = _looping(files)
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 3, timeout=60)
        door = {"source": {"type": "url", "url": "rtsp://admin:hunter2@127.0.0.1:9/live"}, "slot": "cls"}
        files.write_config(
            model=files.v2, version="2", stream=stream, streams={"door": door}, telemetry={"interval_s": 5.0}
        )
        daemon.signal(signal.SIGHUP)
        applied = daemon.wait_for_event("config.reload.applied")
        probe.wait_for(lambda ms: any(r.model.version == "2" for r in unique_results(ms, topic)), timeout=30)
        daemon.signal(signal.SIGHUP)  # nothing new: the keys that wait for a restart are said again
        wait_until(lambda: len(_events(daemon, "config.reload.applied")) == 2, 20, "the second reload")
    finally:
        assert daemon.stop() == 0
    changed = applied["changed"]
    assert changed["slots.cls.model"] == {"old": str(files.v1), "new": str(files.v2)}
    assert changed["slots.cls.version"] == {"old": "1", "new": "2"}
    assert changed["telemetry.interval_s"] == {"old": 1.0, "new": 5.0}
    assert changed["streams.door.source.url"] == {"new": "rtsp://admin:***@127.0.0.1:9/live"}
    assert applied["swapping"] == ["cls"]
    assert "telemetry.interval_s" in applied["restart_required"]
    assert "streams.door.source.url" in applied["restart_required"]
    assert not any(key.startswith("slots.") for key in applied["restart_required"])
    assert "hunter2" not in daemon.log()
    second = _events(daemon, "config.reload.applied")[1]
    assert not any(key.startswith("slots.") for key in second["changed"])
    assert second["swapping"] == []
    assert second["restart_required"] == applied["restart_required"]


def test_a_second_rollback_is_refused_instead_of_swapping_forward(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = _looping(files)
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    topic = f"fleet/v1/{device_id}/up/results/cam"
    settings = MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.2, reconnect_max_s=1.0)
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 3, timeout=60)
        files.write_config(model=files.v2, version="2", stream=stream)
        daemon.signal(signal.SIGHUP)
        probe.wait_for(lambda ms: any(r.model.version == "2" for r in unique_results(ms, topic)), timeout=30)
        first = send_command(settings, device_id, "rollback", {"slot": "cls"}, timeout=20)
        second = send_command(settings, device_id, "rollback", {"slot": "cls"}, timeout=20)
        probe.clear()
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 5, timeout=30)
    finally:
        assert daemon.stop() == 0
    assert first.ok, first.error
    assert first.result is not None
    assert first.result["model"]["version"] == "1"
    assert (second.ok, second.error_code) == (False, "no_rollback_target")
    assert "already rolled back to cls 1" in (second.error or "")
    assert "never forward" in (second.error or "")
    # Still on the model the first rollback chose, and state.json says there is nothing older.
    assert {r.model.version for r in unique_results(probe.snapshot(), topic)} == {"1"}
    state = json.loads((tmp_path / "state" / "state.json").read_text())["slots"]["cls"]
    assert (state["active"]["version"], state["active"]["origin"]) == ("1", "rollback")
    assert state["last_known_good"] is None
