"""Every telemetry name a real daemon sends becomes the right Prometheus series, on the agent's own
``/metrics`` and on the controller's.

The names are collected from a real run (the daemon, a real mosquitto, a looping video file and a
SIGHUP hot swap, so the slot passes loading, validating and active), not taken from the docs: a
device-chosen name may hold dots, and a rule that reads part of a figure's name as part of a slot's
or stream's name (``slot.cls.transitions.active`` exported as ``edge_slot_active{slot=
"cls.transitions"}``) shows as a slot or stream the device does not have.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.demo.broker import Broker, free_port
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.view.live import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import StatusMessage, encode
from agent.telemetry.series import series_of
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

pytestmark = pytest.mark.slow

#: Figures the daemon sends that no rule exports, each with why (docs/operations.md says the same).
NOT_EXPORTED = {
    # The model's identity is a label of edge_slot_model_info (its whole sha256), not a number.
    "slot.cls.model_sha7",
}
SLOT_STATES = {"loading", "validating", "active"}


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _check_names_of_the_device(samples: list[tuple[str, dict[str, str], float]]) -> None:
    """Only the slot and the stream the device has, and its transitions under their own metric."""
    assert {labels["slot"] for _, labels, _ in samples if "slot" in labels} == {"cls"}
    assert {labels["stream"] for _, labels, _ in samples if "stream" in labels} == {"cam"}
    transitions = {labels["state"] for name, labels, _ in samples if name == "edge_slot_transitions_total"}
    assert transitions == SLOT_STATES


def _telemetry_after_swap(messages: list[Received]) -> bool:
    """A telemetry message counting the swap's second entry into ACTIVE (the first was the start)."""
    return any(
        m.topic.endswith("/up/telemetry") and json.loads(m.payload).get("slot.cls.transitions.active", 0) >= 2
        for m in messages
    )


def test_every_telemetry_name_of_a_real_daemon_maps_to_its_metric(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    port = free_port()
    telemetry = {"interval_s": 0.5, "prometheus": {"port": port}}
    daemon = Daemon(files.write_config(stream=stream, telemetry=telemetry), tmp_path / "agent.log")
    results = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, results)) >= 10, timeout=60)
        files.write_config(model=files.v2, version="2", stream=stream, telemetry=telemetry)
        daemon.signal(signal.SIGHUP)
        probe.wait_for(_telemetry_after_swap, timeout=60)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=patient(10)) as reply:
            agent_text = reply.read().decode()
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-2000:]
    messages = probe.snapshot()
    names = {
        name
        for m in messages
        if m.topic.endswith("/up/telemetry")
        for name in json.loads(m.payload)
        if name != "ts"
    }
    assert {f"slot.cls.transitions.{state}" for state in SLOT_STATES} <= names

    # The mapping itself: every name but the listed ones is exported; a slot or stream label is
    # only ever the device's own slot or stream; a transition is a transition.
    unmapped = {name for name in names if series_of(name) is None}
    assert unmapped == NOT_EXPORTED
    for name in names - NOT_EXPORTED:
        found = series_of(name)
        assert found is not None
        labels = dict(found.labels)
        assert labels.get("slot", "cls") == "cls", name
        assert labels.get("stream", "cam") == "cam", name
        if ".transitions." in name:
            assert found.metric == "edge_slot_transitions_total", name
            assert labels["state"] == name.rsplit(".", 1)[1]

    # The agent's own /metrics.
    _check_names_of_the_device(_samples(agent_text))

    # The controller's: the same messages through its fleet view.
    view = FleetView("fleet/v1")
    for m in messages:
        view.apply(InboundMessage(m.topic, m.payload, qos=m.qos, retain=m.retain))
    # The daemon stopped (its status is offline): bring it back online to see its telemetry series.
    online = StatusMessage(state="online", session=99, agent_version="x")
    view.apply(InboundMessage(f"fleet/v1/{device_id}/up/status", encode(online), qos=1, retain=True))
    last_telemetry = [m for m in messages if m.topic.endswith("/up/telemetry")][-1]
    view.apply(InboundMessage(last_telemetry.topic, last_telemetry.payload, qos=0, retain=False))
    scraped = _samples(fleet_metrics(view).render().decode())
    _check_names_of_the_device([s for s in scraped if s[1].get("device") == device_id])
