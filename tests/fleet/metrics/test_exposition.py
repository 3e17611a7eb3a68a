"""The controller's /metrics exposition, read back with prometheus_client's own text parser."""

from __future__ import annotations

import gzip
import hashlib
import random
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import agent.fleet.view.device_record as device_record
from agent.fleet.metrics.device_series import DEVICE_HASH_CHARS, MAX_SLOTS, device_label, label_name
from agent.fleet.metrics.exposition import FleetMetrics, fleet_metrics
from agent.fleet.metrics.kept_fleet import MAX_LABEL_KEYS
from agent.fleet.metrics.serving import metrics_asgi_app, serve_metrics
from agent.fleet.rollout.records import RolloutPlan, RolloutState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.device_record import MAX_FIGURES, MAX_JOBS
from agent.fleet.view.live import MAX_DEVICE_ID, FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import (
    InfoMessage,
    JobState,
    JobStatus,
    ModelRef,
    RunsInfo,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from agent.telemetry.prometheus import TelemetryEndpoint
from agent.telemetry.series import LABEL_VALUE_LIMIT, series_of
from tests.waiting import patient

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


def samples(metrics: FleetMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples_of(metrics.render().decode())


def samples_of(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
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
    got = samples(fleet_metrics(view))
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
    got = samples(fleet_metrics(view))
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
    got = samples(fleet_metrics(view))
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
    reads: list[str] = []

    def counts(rollout_id: str) -> list[tuple[int, str, str, int]]:
        reads.append(rollout_id)
        return store.device_counts(rollout_id)

    metrics = fleet_metrics(view, lambda: [store.rollout("r1")], counts, store.change_mark)
    got = samples(metrics)
    assert find(got, "edge_rollout_info", rollout_id="r1", slot="main", to_version="5", state="PAUSED") == 1
    # 1-based, as the CLI and the console count waves (issue 22.6)
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="1", step="PLANNED") == 1
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="2", step="PLANNED") == 2
    samples(metrics)
    assert reads == ["r1"]  # the store did not change: not read again
    # A change through the store shows in the next scrape...
    store.mark_sending("r1", "jet-a")
    got = samples(metrics)
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="1", step="SENDING") == 1
    assert find(got, "edge_rollout_devices", rollout_id="r1", wave="1", step="PLANNED") is None
    # ... and so does one written to the same file through another connection.
    other = RolloutStore(tmp_path / "rollouts.sqlite")
    other.set_state("r1", RolloutState.RUNNING)
    other.close()
    assert find(samples(metrics), "edge_rollout_info", rollout_id="r1", state="RUNNING") == 1
    store.close()


def test_device_text_in_labels_is_escaped_and_cut() -> None:
    view = FleetView(PREFIX)
    name = 'cam"0\\x'
    feed(
        view,
        Topics(PREFIX, "jet").telemetry,
        encode(
            TelemetryMessage(
                **{
                    f"stream.{name}.fps": 1.0,
                    f"stream.{'s' * 300}.fps": 2.0,
                    f"stream.{'s' * 299}t.fps": 3.0,  # the same 128 characters once cut
                }
            )
        ),
    )
    feed(
        view,
        Topics(PREFIX, "jet").status,
        encode(StatusMessage(state="online", session=1, agent_version="x")),
    )
    text = fleet_metrics(view).render().decode()
    got = samples_of(text)
    assert find(got, "edge_stream_frames_per_second", stream=name) == 1.0
    assert find(got, "edge_stream_frames_per_second", stream="s" * 128) == 2.0  # the first one
    # Written once: Prometheus drops a scrape's repeated series (and counts them as errors).
    assert text.count(f'edge_stream_frames_per_second{{device="jet",stream="{"s" * 128}"}}') == 1


def test_label_names_from_device_label_keys() -> None:
    assert label_name("site") == "site"
    assert label_name("example.com/hw") == "example_com_hw"
    assert label_name("device") == "label_device"
    assert label_name("9lives") == "label_9lives"


def test_serve_metrics_answers_over_http() -> None:
    view = FleetView(PREFIX)
    device(view, "jet-a", site="lab")
    server = serve_metrics(view)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=patient(10)) as reply:
            text = reply.read().decode()
            assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        # Prometheus asks for gzip: the same text, compressed.
        asked = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(asked, timeout=patient(10)) as reply:
            assert reply.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(reply.read()).decode() == text
    finally:
        server.stop()
    assert 'edge_device_online{device="jet-a"} 1.0' in text


def _series_of_device(text: str, label: str) -> list[str]:
    return [
        s.name
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("device") == label
    ]


def test_every_kind_of_change_shows_in_the_next_scrape() -> None:
    clock = Clock()  # never moves between two messages: a change is seen by its mark, not by its time
    view = FleetView(PREFIX, stale_after_s=30, clock=clock)
    device(view, "jet-a", site="lab")
    device(view, "jet-b", site="lab")
    metrics = fleet_metrics(view)
    assert find(samples(metrics), "edge_stream_frames_per_second", device="jet-a") == 29.5
    topics = Topics(PREFIX, "jet-a")

    feed(view, topics.telemetry, encode(TelemetryMessage(**{**FIGURES, "stream.cam0.fps": 12.0})))
    assert find(samples(metrics), "edge_stream_frames_per_second", device="jet-a") == 12.0

    device(view, "jet-a", site="yard", version="5")  # a new up/info (and the same telemetry again)
    got = samples(metrics)
    assert find(got, "edge_slot_model_info", device="jet-a", version="5") == 1
    assert find(got, "edge_slot_model_info", device="jet-a", version="4") is None
    assert find(got, "edge_device_info", device="jet-a", site="yard") == 1

    feed(view, topics.jobs("j1"), encode(JobStatus(job_id="j1", slot="main", state=JobState.DOWNLOADING)))
    assert find(samples(metrics), "edge_slot_job_info", device="jet-a", state="DOWNLOADING") == 1

    feed(view, topics.telemetry, b"{not json")
    assert find(samples(metrics), "edge_device_malformed_messages", device="jet-a") == 1

    feed(view, topics.status, encode(StatusMessage(state="offline", session=3, agent_version="0.9")))
    got = samples(metrics)
    assert find(got, "edge_device_online", device="jet-a") == 0
    assert find(got, "edge_stream_frames_per_second", device="jet-a") is None  # offline: left out
    assert find(got, "edge_fleet_devices", state="offline") == 1

    clock.now += 31  # no message at all: jet-b turns stale by the clock alone
    got = samples(metrics)
    assert find(got, "edge_device_stale", device="jet-b") == 1
    assert find(got, "edge_stream_frames_per_second", device="jet-b") is None
    feed(view, Topics(PREFIX, "jet-b").telemetry, encode(TelemetryMessage(**FIGURES)))
    assert find(samples(metrics), "edge_stream_frames_per_second", device="jet-b") == 29.5


def test_a_scrape_redoes_only_the_devices_that_changed() -> None:
    view = FleetView(PREFIX)
    for i in range(50):
        device(view, f"jet-{i:02d}", site="lab")
    metrics = fleet_metrics(view)
    first = metrics.render()
    assert metrics.rendered_devices == 50
    assert metrics.render() == first  # nothing changed: the same text, nothing redone
    assert metrics.rendered_devices == 50
    feed(view, Topics(PREFIX, "jet-07").telemetry, encode(TelemetryMessage(**{"cpu.percent": 99.0})))
    text = metrics.render().decode()
    assert metrics.rendered_devices == 51
    assert 'edge_cpu_percent{device="jet-07"} 99.0' in text
    assert 'edge_cpu_percent{device="jet-08"} 40.0' in text


def test_a_long_device_id_is_cut_with_a_hash_of_the_whole_id() -> None:
    view = FleetView(PREFIX)
    # The longest ids the view takes (MAX_DEVICE_ID; longer ones are refused there), all but the
    # last character shared.
    long_a, long_b = "j" * (MAX_DEVICE_ID - 1) + "a", "j" * (MAX_DEVICE_ID - 1) + "b"
    for name in ("jet-short", long_a, long_b):
        device(view, name, site="lab")
    text = fleet_metrics(view).render().decode()
    label_a, label_b = device_label(long_a), device_label(long_b)
    assert label_a != label_b
    assert len(label_a) == len(label_b) == LABEL_VALUE_LIMIT
    assert label_a == long_a[:111] + "/" + hashlib.sha256(long_a.encode()).hexdigest()[:16]
    assert "/" in label_a  # '/' is never in an id (a topic level): no real id reads the same
    assert device_label("jet-short") == "jet-short"
    assert device_label("x" * LABEL_VALUE_LIMIT) == "x" * LABEL_VALUE_LIMIT
    # Every series of each device carries its own cut label, and no label is longer than the cap.
    for label in (label_a, label_b):
        names = _series_of_device(text, label)
        assert "edge_device_online" in names
        assert "edge_stream_frames_per_second" in names
        assert len(names) == len(_series_of_device(text, "jet-short"))
    assert all(
        len(value) <= LABEL_VALUE_LIMIT
        for family in text_string_to_metric_families(text)
        for s in family.samples
        for value in s.labels.values()
    )


def test_slot_series_are_capped_per_device_and_the_slots_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # The view keeps an up/info within INFO_BYTES (some 40 of these slots); the cap here is the
    # second bound, for a view told to keep more: lift the first one to reach it.
    monkeypatch.setattr(device_record, "INFO_BYTES", 64 * 1024 * 1024)
    view = FleetView(PREFIX)
    slots = {
        f"s{i:05d}": SlotInfo(
            model=ModelRef(slot=f"s{i:05d}", model_id="net", version="1", sha256="ab" * 32), state="active"
        )
        for i in range(10_000)
    }
    info = InfoMessage(
        device_id="jet-many", agent_version="0.9", platform={}, backends={}, slots=slots, streams=[]
    )
    feed(view, Topics(PREFIX, "jet-many").info, encode(info))
    got = samples(fleet_metrics(view))
    assert find(got, "edge_device_slots", device="jet-many") == 10_000
    models = [labels for (name, labels) in got if name == "edge_slot_model_info"]
    assert len(models) == MAX_SLOTS
    assert find(got, "edge_slot_model_info", slot="s00000") == 1  # the first by name
    assert find(got, "edge_slot_model_info", slot=f"s{MAX_SLOTS:05d}") is None
    assert len([n for (n, labels) in got if ("device", "jet-many") in labels]) <= MAX_SLOTS + 8


def test_a_transition_count_is_a_transition_on_both_metrics_endpoints() -> None:
    figures = {f"slot.cls.transitions.{state}": 2.0 for state in ("empty", "loading", "validating", "active")}
    figures["slot.cls.active"] = 1.0
    view = FleetView(PREFIX)
    feed(
        view,
        Topics(PREFIX, "jet").status,
        encode(StatusMessage(state="online", session=1, agent_version="x")),
    )
    feed(view, Topics(PREFIX, "jet").telemetry, encode(TelemetryMessage(**figures)))
    endpoint = TelemetryEndpoint("127.0.0.1", 0, stale_after_s=60)
    endpoint.update(figures)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(endpoint)
    for text in (fleet_metrics(view).render().decode(), generate_latest(registry).decode()):
        got = {
            (s.name, s.labels.get("slot"), s.labels.get("state")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if "slot" in s.labels
        }
        want: dict[tuple[str, str | None, str | None], float] = {
            ("edge_slot_transitions_total", "cls", state): 2.0
            for state in ("empty", "loading", "validating", "active")
        }
        want["edge_slot_active", "cls", None] = 1.0
        assert got == want


def test_the_console_app_serves_the_same_text_plain_and_gzipped() -> None:
    view = FleetView(PREFIX)
    device(view, "jet-a", site="lab")
    metrics = fleet_metrics(view)
    client = TestClient(metrics_asgi_app(metrics))
    plain = client.get("/metrics")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'edge_device_online{device="jet-a"} 1.0' in plain.text
    zipped = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.text == plain.text  # the client undoes the gzip


def test_the_kept_lines_always_equal_a_fresh_render() -> None:
    """Whatever happens between scrapes, a scrape is what a collector with nothing kept would write."""
    clock = Clock()
    view = FleetView(PREFIX, stale_after_s=30, clock=clock)
    kept = fleet_metrics(view)
    rng = random.Random(7)
    names = [f"jet-{i}" for i in range(12)]
    for step in range(300):
        name = rng.choice(names)
        what = rng.randrange(6)
        if what == 0:
            device(view, name, site=rng.choice(["lab", "yard"]), version=str(rng.randrange(3)))
        elif what == 1:
            figures = {**FIGURES, "cpu.percent": float(rng.randrange(100))}
            if rng.random() < 0.3:  # other figures: families in another order, some missing
                figures = {"gpu.freq_mhz": float(rng.randrange(900)), "cpu.percent": 2.0, "x.y": 1.0}
            feed(view, Topics(PREFIX, name).telemetry, encode(TelemetryMessage(**figures)))
        elif what == 2:
            state = rng.choice(["online", "offline"])
            status = StatusMessage(state=state, session=step, agent_version="0.9")
            feed(view, Topics(PREFIX, name).status, encode(status))
        elif what == 3:
            job = JobStatus(job_id=f"j{step}", slot="main", state=rng.choice(list(JobState)))
            feed(view, Topics(PREFIX, name).jobs(job.job_id), encode(job))
        elif what == 4:
            clock.now += rng.choice([1, 10, 31])  # devices turn stale by the clock alone
        else:  # a malformed message: a problem line of the device
            topics = Topics(PREFIX, name)
            feed(view, rng.choice([topics.telemetry, topics.info, topics.status]), b"{not json")
        if rng.random() < 0.2:
            kept.prepare()  # the warm pass, between scrapes
        if rng.random() < 0.3:
            assert kept.render() == fleet_metrics(view).render(), step


def test_scrapes_during_a_telemetry_flood_end_equal_to_a_fresh_render() -> None:
    view = FleetView(PREFIX)
    for i in range(20):
        device(view, f"jet-{i:02d}", site="lab")
    kept = fleet_metrics(view)
    stop = threading.Event()

    def flood() -> None:
        n = 0
        while not stop.is_set():
            figures = {**FIGURES, "cpu.percent": float(n % 100)}
            feed(view, Topics(PREFIX, f"jet-{n % 20:02d}").telemetry, encode(TelemetryMessage(**figures)))
            n += 1

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        for _ in range(20):
            samples(kept)  # every scrape parses, mid-flood
    finally:
        stop.set()
        thread.join()
    assert kept.render() == fleet_metrics(view).render()


def test_the_operations_doc_states_the_bounds_and_readings_the_code_has() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text(encoding="utf-8")
    section = doc.split("**What one device can cost `/metrics`.**", 1)[1].split("**Scrape time.**", 1)[0]
    prose = " ".join(section.split())
    cut = LABEL_VALUE_LIMIT - DEVICE_HASH_CHARS - 1
    assert f"label values are cut to {LABEL_VALUE_LIMIT} characters" in prose
    assert f"its first {cut} characters, `/` and {DEVICE_HASH_CHARS} hex digits" in prose
    assert f"at most {MAX_LABEL_KEYS} device label keys" in prose
    assert f"at most {MAX_SLOTS} slots per device" in prose
    assert f"`edge_device_slots > {MAX_SLOTS}`" in prose
    assert f"last {MAX_JOBS} jobs" in prose
    assert f"({MAX_FIGURES:,} per message at most)" in prose
    found = series_of("slot.cls.transitions.active")
    assert found is not None
    labels = ",".join(f'{k}="{v}"' for k, v in found.labels)
    assert f"`slot.cls.transitions.active` is `{found.metric}{{{labels}}}`" in prose
    assert series_of("slot.cls.model_sha7") is None
    assert "the one figure left out is `slot.<slot>.model_sha7`" in prose


def test_at_most_max_label_keys_become_labels_of_device_info() -> None:
    view = FleetView(PREFIX)
    labels = {f"k{i:02d}": "v" for i in range(MAX_LABEL_KEYS + 8)}
    info = InfoMessage(
        device_id="jet", agent_version="1", platform={}, backends={}, labels=labels, slots={}, streams=[]
    )
    feed(view, Topics(PREFIX, "jet").info, encode(info))
    (info_labels,) = [ls for (name, ls) in samples(fleet_metrics(view)) if name == "edge_device_info"]
    assert len([k for k, _ in info_labels if k.startswith("k")]) == MAX_LABEL_KEYS


def test_what_each_slot_really_runs_is_a_series_with_bounded_labels_and_1_on_a_fallback() -> None:
    view = FleetView(PREFIX)
    guard = "INT8 accuracy guard: INT8 top-1 agrees with FP32 on 18.8% of 64 held-out frames"
    slots = {
        "cls": RunsInfo(requested="int8", precision="fp32", source="built", fallback=guard),
        "det": RunsInfo(requested="fp16", precision="fp16", source="downloaded"),
        "aux": RunsInfo(requested="int8", source="interim"),
        "odd": RunsInfo(requested="q" * 5000, precision="p" * 5000, source="built", fallback="w" * 5000),
    }
    feed(
        view,
        Topics(PREFIX, "jet-a").status,
        encode(StatusMessage(state="online", session=1, agent_version="1")),
    )
    info = InfoMessage(
        device_id="jet-a",
        agent_version="1",
        platform={},
        backends={},
        slots={
            name: SlotInfo(
                model=ModelRef(slot=name, model_id="net", version="4", sha256="ab" * 32),
                state="active",
                runs=runs,
            )
            for name, runs in slots.items()
        },
        streams=[],
    )
    feed(view, Topics(PREFIX, "jet-a").info, encode(info))
    got = samples(fleet_metrics(view))
    name = "edge_slot_precision_fallback"
    assert (
        find(got, name, device="jet-a", slot="cls", requested="int8", precision="fp32", source="built") == 1
    )
    assert find(got, name, slot="det", requested="fp16", precision="fp16", source="downloaded") == 0
    assert find(got, name, slot="aux", requested="int8", precision="", source="interim") == 0
    assert find(got, name, slot="odd", requested="q" * 16, precision="p" * 16, source="built") == 1
    # The reason is for people (fleet status, the console): never a label, whatever its length.
    assert not any(guard in dict(labels).values() for (_n, labels) in got)
