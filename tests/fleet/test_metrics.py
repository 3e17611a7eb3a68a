"""The fleet collector's exposition, read back with prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet.metrics import label_name, metrics_registry, serve_metrics
from agent.fleet.rollout_store import RolloutPlan, RolloutState, RolloutStore
from agent.fleet.view import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import (
    InfoMessage,
    JobState,
    JobStatus,
    ModelRef,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics

PREFIX = "fleet/v1"

#: One device's telemetry with a field of every kind the rules know (names from docs/operations.md).
FIGURES = {
    "stream.cam0.fps": 29.5,
    "stream.cam0.frames_published": 51234,
    "stream.cam0.dropped.queue_full": 3,
    "stream.cam0.latency.total.p99_ms": 12.5,
    "stream.cam0.latency.total.count": 51234,
    "slot.main.latency.infer.p50_ms": 4.0,
    "slot.main.active": 1,
    "slot.main.shadow.active": 0,
    "mqtt.connected": 1,
    "mqtt.spool_depth": 7,
    "process.rss_mb": 100.0,
    "cpu.percent": 40.0,
    "temp.cpu_therm_c": 51.5,
    "gpu.load_percent": 70.0,
    "gpu.freq_mhz": 918.0,
    "something.new": 1.0,
}


class Clock:
    """A settable clock: staleness without sleeping."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def feed(view: FleetView, topic: str, payload: bytes) -> None:
    view.apply(InboundMessage(topic=topic, payload=payload, qos=1, retain=False))


def device(view: FleetView, name: str, *, site: str, version: str = "4", online: bool = True) -> None:
    topics = Topics(PREFIX, name)
    state = "online" if online else "offline"
    feed(view, topics.status, encode(StatusMessage(state=state, session=3, agent_version="0.9")))
    info = InfoMessage(
        device_id=name,
        agent_version="0.9",
        platform={"device_model": "Orin NX", "jetpack": "6.0", "dla_cores": 2},
        labels={"site": site, "example.com/hw": "orin-nx"},
        backends={},
        slots={
            "main": SlotInfo(
                model=ModelRef(slot="main", model_id="net", version=version, sha256="ab" * 32), state="active"
            )
        },
        streams=["cam0"],
    )
    feed(view, topics.info, encode(info))
    feed(view, topics.telemetry, encode(TelemetryMessage(**FIGURES)))


def samples(registry: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def find(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    for (n, ls), value in got.items():
        if n == name and set(labels.items()) <= ls:
            return value
    return None


def test_telemetry_figures_become_named_series_with_units_and_labels() -> None:
    view = FleetView(PREFIX)
    device(view, "jet-a", site="lab")
    got = samples(metrics_registry(view))
    assert find(got, "edge_stream_frames_per_second", device="jet-a", stream="cam0") == 29.5
    assert find(got, "edge_stream_frames_total", device="jet-a", stream="cam0", stage="published") == 51234
    assert find(got, "edge_stream_dropped_frames_total", device="jet-a", reason="queue_full") == 3
    assert find(got, "edge_stream_latency_seconds", stage="total", quantile="0.99") == 0.0125
    assert find(got, "edge_stream_latency_observations_total", stage="total") == 51234
    assert find(got, "edge_slot_latency_seconds", slot="main", stage="infer", quantile="0.5") == 0.004
    assert find(got, "edge_slot_guard_active", slot="main", guard="shadow") == 0
    assert find(got, "edge_slot_active", slot="main") == 1
    assert find(got, "edge_mqtt_spool_depth_messages", device="jet-a") == 7
    assert find(got, "edge_process_resident_memory_bytes", device="jet-a") == 100 * 1024 * 1024
    assert find(got, "edge_temperature_celsius", device="jet-a", zone="cpu_therm") == 51.5
    assert find(got, "edge_load_percent", unit="gpu") == 70
    assert find(got, "edge_clock_hertz", clock="gpu") == 918e6
    assert not any("something" in name for name, _ in got)  # no rule, no series


def test_status_info_and_slot_series() -> None:
    view = FleetView(PREFIX)
    device(view, "jet-a", site="lab")
    feed(
        view,
        Topics(PREFIX, "jet-a").jobs("j9"),
        encode(JobStatus(job_id="j9", slot="main", state=JobState.FAILED, error_code="build_failed")),
    )
    got = samples(metrics_registry(view))
    assert find(got, "edge_device_online", device="jet-a") == 1
    assert find(got, "edge_device_stale", device="jet-a") == 0
    assert find(got, "edge_device_session", device="jet-a") == 3
    assert (
        find(
            got, "edge_device_info", device="jet-a", site="lab", example_com_hw="orin-nx", agent_version="0.9"
        )
        == 1
    )
    assert find(got, "edge_device_platform_info", device="jet-a", jetpack="6.0", dla_cores="2") == 1
    assert find(got, "edge_slot_model_info", device="jet-a", slot="main", model_id="net", version="4") == 1
    assert (
        find(got, "edge_slot_job_info", slot="main", job_id="j9", state="FAILED", error_code="build_failed")
        == 1
    )
    assert find(got, "edge_fleet_devices", state="online") == 1


def test_a_stale_or_offline_device_loses_its_telemetry_series_but_keeps_online() -> None:
    clock = Clock()
    view = FleetView(PREFIX, stale_after_s=30, clock=clock)
    device(view, "jet-a", site="lab")
    device(view, "jet-b", site="lab")
    device(view, "jet-c", site="yard", online=False)
    clock.now += 20
    feed(view, Topics(PREFIX, "jet-b").telemetry, encode(TelemetryMessage(**FIGURES)))
    clock.now += 15  # jet-a silent for 35 s, jet-b for 15 s
    got = samples(metrics_registry(view))
    assert find(got, "edge_stream_frames_per_second", device="jet-a") is None
    assert find(got, "edge_stream_frames_per_second", device="jet-b") == 29.5
    assert find(got, "edge_stream_frames_per_second", device="jet-c") is None
    assert find(got, "edge_device_stale", device="jet-a") == 1
    assert find(got, "edge_device_online", device="jet-a") == 1  # online, just silent
    assert find(got, "edge_device_online", device="jet-c") == 0
    assert find(got, "edge_device_info", device="jet-c") == 1  # what it is stays known


def test_rollout_series_from_a_real_rollout_store(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    store.create(RolloutPlan("r1", "main", "job-r1", "5", waves=[["jet-a"], ["jet-b", "jet-c"]]))
    store.set_state("r1", RolloutState.PAUSED)
    view = FleetView(PREFIX)
    registry = metrics_registry(view, lambda: [store.rollout("r1")], store.devices)
    got = samples(registry)
    store.close()
    assert find(got, "edge_rollout_info", rollout_id="r1", slot="main", to_version="5", state="PAUSED") == 1
    # 1-based, as the CLI and the console count waves (issue 22.6)
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="1", step="PLANNED") == 1
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="2", step="PLANNED") == 2


def test_device_text_in_labels_is_escaped_and_cut() -> None:
    view = FleetView(PREFIX)
    name = 'cam"0\\x'
    feed(
        view,
        Topics(PREFIX, "jet").telemetry,
        encode(TelemetryMessage(**{f"stream.{name}.fps": 1.0, f"stream.{'s' * 300}.fps": 2.0})),
    )
    feed(
        view,
        Topics(PREFIX, "jet").status,
        encode(StatusMessage(state="online", session=1, agent_version="x")),
    )
    got = samples(metrics_registry(view))
    assert find(got, "edge_stream_frames_per_second", stream=name) == 1.0
    assert find(got, "edge_stream_frames_per_second", stream="s" * 128) == 2.0


def test_label_names_from_device_label_keys() -> None:
    assert label_name("site") == "site"
    assert label_name("example.com/hw") == "example_com_hw"
    assert label_name("device") == "label_device"
    assert label_name("9lives") == "label_9lives"


def test_serve_metrics_answers_over_http() -> None:
    view = FleetView(PREFIX)
    device(view, "jet-a", site="lab")
    server = serve_metrics(view)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.stop()
    assert 'edge_device_online{device="jet-a"} 1.0' in text
