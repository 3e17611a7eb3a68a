"""What the controller takes of the devices' telemetry and what it drops, counted and on /metrics;
and /metrics kept warm between scrapes. Real mosquitto, real MQTT clients."""

from __future__ import annotations

import gzip
import threading

from prometheus_client.parser import text_string_to_metric_families

from agent.demo.broker import Broker
from agent.fleet.metrics.exposition import (
    AHEAD_FRESH_S,
    AHEAD_S,
    SCRAPE_RENDERS,
    WARM_TELEMETRY_EVERY_S,
    FleetMetrics,
    fleet_metrics,
)
from agent.fleet.metrics.intake_series import IntakeFigures
from agent.fleet.metrics.scrape_cadence import MIN_PERIOD_S, ScrapeCadence
from agent.fleet.view.live import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import StatusMessage, TelemetryMessage, encode
from agent.protocol.topics import Topics
from tests.waiting import patient, wait_until

PREFIX = "intake/v1"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _telemetry(fps: float) -> bytes:
    return encode(TelemetryMessage.model_validate({"stream.cam0.fps": fps}))


def _status(device: str) -> tuple[str, bytes]:
    return Topics(PREFIX, device).status, encode(StatusMessage(state="online", session=1, agent_version="1"))


def test_a_client_behind_sheds_telemetry_first_and_counts_it_keeping_every_status(broker: Broker) -> None:
    settings = MqttSettings(host=broker.host, port=broker.port)
    handled: list[InboundMessage] = []
    release = threading.Event()

    def slow(message: InboundMessage) -> None:
        release.wait(patient(30))  # the dispatcher is stuck: the inbox fills behind it
        handled.append(message)

    receiver = ServiceClient(
        settings,
        handler=slow,
        inbox_size=8,
        sheddable=lambda m: m.topic.endswith("/up/telemetry"),
    ).start()
    sender = ServiceClient(settings).start()
    try:
        receiver.subscribe(f"{PREFIX}/+/up/#", qos=1)
        telemetry = Topics(PREFIX, "cam-1").telemetry
        for n in range(30):  # QoS 1: the broker delivers every one, in order
            sender.publish(telemetry, _telemetry(float(n)), qos=1)
        statuses = [_status(f"cam-{n}") for n in range(3)]
        for topic, payload in statuses:
            sender.publish(topic, payload, qos=1)
        assert sender.wait_published(patient(10))
        # Every message reached the client: one in the handler, the rest waiting or shed.
        wait_until(lambda: receiver.inbox_shed + len(receiver._inbox) == 32, 10, "all received")
        release.set()
        wait_until(lambda: len(handled) == 33 - receiver.inbox_shed, 10, "the inbox drained")
    finally:
        release.set()
        sender.stop()
        receiver.stop()
    assert receiver.inbox_shed > 0
    assert receiver.inbox_dropped == 0
    assert [m.topic for m in handled if m.topic.endswith("/up/status")] == [t for t, _ in statuses]
    taken = [m for m in handled if m.topic.endswith("/up/telemetry")]
    assert len(taken) + receiver.inbox_shed == 30
    assert receiver.stats()["inbox_shed"] == receiver.inbox_shed


def test_the_view_counts_the_telemetry_it_takes_and_not_what_it_refuses() -> None:
    view = FleetView(PREFIX, max_devices=1, stale_after_s=3600.0)
    for fps in (1.0, 2.0, 3.0):
        view.apply(InboundMessage(Topics(PREFIX, "cam-1").telemetry, _telemetry(fps), qos=0, retain=False))
    view.apply(InboundMessage(Topics(PREFIX, "cam-1").telemetry, b"not json", qos=0, retain=False))
    # The view is full with an online, talking device: the second device's telemetry is refused.
    topic, payload = _status("cam-1")
    view.apply(InboundMessage(topic, payload, qos=1, retain=True))
    view.apply(InboundMessage(Topics(PREFIX, "cam-2").telemetry, _telemetry(1.0), qos=0, retain=False))
    assert view.telemetry_taken == 4
    assert view.refused_devices == 1


def test_the_intake_counters_are_on_metrics_as_they_are_now() -> None:
    view = FleetView(PREFIX)
    figures = [IntakeFigures(telemetry_taken=5, telemetry_shed=0, inbox_full=0)]
    metrics = fleet_metrics(view, intake=lambda: figures[-1])
    first = _samples(metrics.render().decode())
    figures.append(IntakeFigures(telemetry_taken=12, telemetry_shed=7, inbox_full=2))
    second = _samples(metrics.render().decode())
    assert first[("edge_fleet_telemetry_messages_total", ())] == 5
    assert first[("edge_fleet_mqtt_dropped_total", (("reason", "telemetry_shed"),))] == 0
    assert second[("edge_fleet_telemetry_messages_total", ())] == 12
    assert second[("edge_fleet_mqtt_dropped_total", (("reason", "telemetry_shed"),))] == 7
    assert second[("edge_fleet_mqtt_dropped_total", (("reason", "inbox_full"),))] == 2


def test_a_scrape_after_prepare_renders_no_device_again_and_shows_what_changed() -> None:
    view = FleetView(PREFIX, stale_after_s=3600.0)
    for n in range(20):
        topic, payload = _status(f"cam-{n}")
        view.apply(InboundMessage(topic, payload, qos=1, retain=True))
    metrics = fleet_metrics(view)
    metrics.prepare()
    assert metrics.rendered_devices == 20
    text = metrics.render().decode()
    assert metrics.rendered_devices == 20
    assert _samples(text)[("edge_fleet_devices", (("state", "online"),))] == 20
    # A status prepared between two scrapes is in the next answer (not the last answer sent again).
    offline = encode(StatusMessage(state="offline", session=1, agent_version="1"))
    view.apply(InboundMessage(Topics(PREFIX, "cam-3").status, offline, qos=1, retain=True))
    metrics.prepare()
    assert metrics.rendered_devices == 21
    text = metrics.render().decode()
    assert metrics.rendered_devices == 21
    assert _samples(text)[("edge_fleet_devices", (("state", "offline"),))] == 1
    # New telemetry figures too: the scrape after them renders nothing.
    view.apply(InboundMessage(Topics(PREFIX, "cam-4").telemetry, _telemetry(12.5), qos=0, retain=False))
    metrics.prepare()
    assert metrics.rendered_devices == 22
    text = metrics.render().decode()
    assert metrics.rendered_devices == 22
    assert "12.5" in text


def test_kept_warm_the_lines_are_rendered_before_anyone_scrapes() -> None:
    view = FleetView(PREFIX, stale_after_s=3600.0)
    metrics = fleet_metrics(view)
    stop = metrics.keep_warm(every_s=0.05)
    try:
        for n in range(5):
            topic, payload = _status(f"cam-{n}")
            view.apply(InboundMessage(topic, payload, qos=1, retain=True))
        wait_until(lambda: metrics.rendered_devices == 5, 10, "warmed")
    finally:
        stop()
    assert _samples(metrics.render().decode())[("edge_fleet_devices", (("state", "online"),))] == 5
    assert metrics.rendered_devices == 5


def test_the_warm_pass_redoes_new_telemetry_at_most_every_few_seconds_and_a_scrape_shows_the_latest() -> None:
    now = [0.0]
    view = FleetView(PREFIX, stale_after_s=3600.0)
    topic, payload = _status("cam-0")
    view.apply(InboundMessage(topic, payload, qos=1, retain=True))
    metrics = FleetMetrics(view, clock=lambda: now[0])
    metrics.prepare()
    telemetry = Topics(PREFIX, "cam-0").telemetry
    view.apply(InboundMessage(telemetry, _telemetry(1.5), qos=0, retain=False))
    metrics.prepare()
    assert metrics.rendered_devices == 2
    view.apply(InboundMessage(telemetry, _telemetry(2.5), qos=0, retain=False))
    metrics.prepare()
    assert metrics.rendered_devices == 2  # within WARM_TELEMETRY_EVERY_S of the last: left to the scrape
    assert _fps(metrics.render().decode()) == 2.5
    assert metrics.rendered_devices == 3
    view.apply(InboundMessage(telemetry, _telemetry(3.5), qos=0, retain=False))
    now[0] += WARM_TELEMETRY_EVERY_S
    metrics.prepare()
    assert metrics.rendered_devices == 4
    assert _fps(metrics.render().decode()) == 3.5
    assert metrics.rendered_devices == 4


def _fps(text: str) -> float:
    return _samples(text)[("edge_stream_frames_per_second", (("device", "cam-0"), ("stream", "cam0")))]


def test_kept_warm_a_scrape_renders_its_share_of_a_fleet_that_moved_at_once_and_the_warm_pass_the_rest() -> (
    None
):
    view = FleetView(PREFIX, stale_after_s=3600.0)
    names = [f"cam-{n:04d}" for n in range(SCRAPE_RENDERS + 50)]
    for name in names:
        view.apply(InboundMessage(*_status(name), qos=1, retain=True))
    metrics = fleet_metrics(view)
    stop = metrics.keep_warm(every_s=3600.0)  # one pass at its start, then none within this test
    try:
        wait_until(lambda: metrics.rendered_devices == len(names), 30, "the first warm pass")
        offline = encode(StatusMessage(state="offline", session=1, agent_version="1"))
        for name in names:
            view.apply(InboundMessage(Topics(PREFIX, name).status, offline, qos=1, retain=True))
        text = metrics.render().decode()
        assert metrics.rendered_devices == len(names) + SCRAPE_RENDERS
        assert _samples(text)[("edge_fleet_devices", (("state", "offline"),))] == SCRAPE_RENDERS
        metrics.prepare()  # the warm pass's next turn
        text = metrics.render().decode()
        assert _samples(text)[("edge_fleet_devices", (("state", "offline"),))] == len(names)
        assert ("edge_fleet_devices", (("state", "online"),)) not in _samples(text)
    finally:
        stop()


def test_a_periodic_scraper_gets_the_answer_built_just_before_its_scrape_was_due() -> None:
    now = [100.0]
    view = FleetView(PREFIX, stale_after_s=3600.0)
    view.apply(InboundMessage(*_status("cam-0"), qos=1, retain=True))
    metrics = FleetMetrics(view, clock=lambda: now[0])
    for _ in range(3):  # every 15 s, as Prometheus scrapes
        metrics.render_gzip()
        now[0] += 15.0
    assert metrics.answer_due() == 145.0 - AHEAD_S
    now[0] = 145.0 - AHEAD_S
    metrics.prepare_answer()  # what the warm thread does then
    assert metrics.answer_due() is None  # built
    view.apply(InboundMessage(*_status("cam-1"), qos=1, retain=True))  # after the answer was built
    now[0] = 145.0
    built = gzip.decompress(metrics.render_gzip()).decode()
    assert _samples(built)[("edge_fleet_devices", (("state", "online"),))] == 1
    assert metrics.answer_due() == 160.0 - AHEAD_S
    now[0] = 160.0 - AHEAD_S
    metrics.prepare_answer()
    now[0] = 160.0 - AHEAD_S + AHEAD_FRESH_S + 0.5  # a late scrape: the answer is too old to send
    assert _samples(metrics.render().decode())[("edge_fleet_devices", (("state", "online"),))] == 2


def test_a_scraper_without_a_period_builds_its_own_answers() -> None:
    cadence = ScrapeCadence()
    for at in (0.0, 15.0, 30.0):
        cadence.scraped(at)
    assert cadence.next_due() == 45.0
    cadence.scraped(33.0)  # a second scraper, or a person: no period any more
    assert cadence.next_due() is None
    polling = ScrapeCadence()
    for at in (0.0, MIN_PERIOD_S / 2, MIN_PERIOD_S):  # a test polling: faster than MIN_PERIOD_S
        polling.scraped(at)
    assert polling.next_due() is None
