"""A real controller counts on its /metrics the telemetry it took from a real broker, and what it
dropped unread (nothing, when it keeps up)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agent.demo.broker import Broker
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import TelemetryMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.controller_process import ControllerProcess
from tests.fleet.operator_side import unique_prefix
from tests.waiting import patient, wait_until


def _counters(controller: ControllerProcess) -> dict[tuple[str, str], float]:
    status, body = controller.get("/metrics")
    assert status == 200
    return {
        (sample.name, str(sample.labels.get("reason", ""))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name in ("edge_fleet_telemetry_messages_total", "edge_fleet_mqtt_dropped_total")
    }


def test_the_controller_counts_every_telemetry_message_it_takes_on_its_metrics(
    tmp_path: Path, broker: Broker
) -> None:
    prefix = unique_prefix()
    controller = ControllerProcess(tmp_path, broker, prefix).start()
    sender = ServiceClient(MqttSettings(host=broker.host, port=broker.port)).start()
    try:
        assert _counters(controller) == {
            ("edge_fleet_telemetry_messages_total", ""): 0.0,
            ("edge_fleet_mqtt_dropped_total", "telemetry_shed"): 0.0,
            ("edge_fleet_mqtt_dropped_total", "inbox_full"): 0.0,
        }
        payload = encode(TelemetryMessage.model_validate({"cpu.percent": 12.0}))
        for n in range(40):  # QoS 1 end to end: the broker drops none of them
            sender.publish(Topics(prefix, f"jet-{n % 4}").telemetry, payload, qos=1)
        assert sender.wait_published(patient(10))
        wait_until(
            lambda: _counters(controller)[("edge_fleet_telemetry_messages_total", "")] >= 40,
            timeout=30,
            what="40 telemetry messages counted",
        )
        counters = _counters(controller)
    finally:
        sender.stop()
        controller.kill()
    assert counters[("edge_fleet_telemetry_messages_total", "")] == 40
    assert counters[("edge_fleet_mqtt_dropped_total", "telemetry_shed")] == 0
    assert counters[("edge_fleet_mqtt_dropped_total", "inbox_full")] == 0
