"""FleetView: the live picture of the fleet, from real messages through a real broker and built ones."""

from __future__ import annotations

import threading

from agent.fleet.view import MAX_JOBS, FleetView
from agent.localbroker import Broker
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.protocol.messages import (
    InfoMessage,
    JobState,
    JobStatus,
    ModelRef,
    ShadowFigures,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

PREFIX = "fleet/v1"


class Clock:
    """A settable clock, so staleness and history are checked without sleeping."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def info(device: str, version: str = "4", **labels: str) -> InfoMessage:
    return InfoMessage(
        device_id=device,
        agent_version="0.9",
        platform={"device_model": "Orin NX", "dla_cores": 2},
        labels=labels,
        backends={},
        slots={
            "main": SlotInfo(
                model=ModelRef(slot="main", model_id="net", version=version, sha256="ab" * 32), state="active"
            )
        },
        streams=["cam0"],
    )


def message(topic: str, payload: bytes, *, retain: bool = False) -> InboundMessage:
    return InboundMessage(topic=topic, payload=payload, qos=1, retain=retain)


def status(device: str, state: str, session: int) -> InboundMessage:
    msg = StatusMessage(state=state, session=session, agent_version="0.9")
    return message(Topics(PREFIX, device).status, encode(msg), retain=True)


def telemetry(device: str, **figures: float) -> InboundMessage:
    return message(Topics(PREFIX, device).telemetry, encode(TelemetryMessage(**figures)))


def job(device: str, job_id: str, state: JobState, ts: float, **extra: object) -> InboundMessage:
    msg = JobStatus(job_id=job_id, slot="main", state=state, ts=ts, **extra)
    return message(Topics(PREFIX, device).jobs(job_id), encode(msg))


def test_devices_from_messages_through_a_real_broker(broker: Broker) -> None:
    prefix = unique_prefix()
    view = FleetView(prefix)
    client = ServiceClient(operator_settings(broker, prefix), handler=view.apply)
    client.start(10)
    try:
        for topic_filter in view.topic_filters():
            client.subscribe(topic_filter, qos=1)
        a = Topics(prefix, "jet-a")
        with Probe(broker.host, broker.port) as device:
            device.publish(a.status, encode(StatusMessage(state="online", session=2, agent_version="0.9")))
            device.publish(a.info, encode(info("jet-a", site="lab", hw="orin-nx")), retain=True)
            device.publish(a.telemetry, encode(TelemetryMessage(**{"stream.cam0.fps": 29.5})), qos=0)
            device.publish(a.jobs("j1"), encode(JobStatus(job_id="j1", slot="main", state=JobState.ACTIVE)))
            wait_until(
                lambda: (d := view.device("jet-a")) is not None and bool(d.telemetry) and bool(d.jobs),
                what="status, info, telemetry and a job of jet-a",
            )
    finally:
        client.stop()
    state = view.device("jet-a")
    assert state is not None
    assert (state.state, state.session, state.agent_version) == ("online", 2, "0.9")
    assert state.labels == {"site": "lab", "hw": "orin-nx"}
    assert state.slots["main"]["version"] == "4"
    assert state.telemetry == {"stream.cam0.fps": 29.5}
    assert not state.stale
    assert [(j.job_id, j.state) for j in state.jobs] == [("j1", "ACTIVE")]
    assert [d.device for d in view.devices()] == ["jet-a"]
    assert view.topic_filters() == [
        f"{prefix}/+/up/status",
        f"{prefix}/+/up/info",
        f"{prefix}/+/up/telemetry",
        f"{prefix}/+/up/jobs/+",
    ]


def test_a_stale_last_will_does_not_turn_a_reconnected_device_offline() -> None:
    view = FleetView(PREFIX)
    assert view.apply(status("jet", "online", 5))
    assert not view.apply(status("jet", "offline", 4))  # the Will of session 4 arrives late
    assert view.device("jet").state == "online"  # type: ignore[union-attr]
    assert view.apply(status("jet", "offline", 5))
    state = view.device("jet")
    assert state is not None
    assert (state.state, state.stale) == ("offline", True)


def test_stale_after_silence_and_fresh_again_on_telemetry() -> None:
    clock = Clock()
    view = FleetView(PREFIX, stale_after_s=30, clock=clock)
    view.apply(status("jet", "online", 1))
    assert not view.device("jet").stale  # type: ignore[union-attr]  # just came online
    clock.now += 31
    assert view.device("jet").stale  # type: ignore[union-attr]  # online, but never a telemetry
    view.apply(telemetry("jet", **{"cpu.percent": 12.0}))
    assert not view.device("jet").stale  # type: ignore[union-attr]
    clock.now += 29
    assert not view.device("jet").stale  # type: ignore[union-attr]
    clock.now += 2
    state = view.device("jet")
    assert state is not None
    assert state.stale
    assert state.telemetry == {"cpu.percent": 12.0}  # the last figures stay readable


def test_history_is_bounded_by_time_and_filtered_by_since() -> None:
    clock = Clock()
    view = FleetView(PREFIX, history_s=100, clock=clock)
    for i in range(5):
        view.apply(telemetry("jet", **{"stream.cam0.fps": float(i)}))
        clock.now += 40
    points = view.history("jet")
    # Points at t0+0..160; now is t0+200: the last 100 s hold t0+120 and t0+160.
    assert [p.figures["stream.cam0.fps"] for p in points] == [3.0, 4.0]
    assert [p.figures["stream.cam0.fps"] for p in view.history("jet", since=clock.now - 50)] == [4.0]
    assert view.history("nobody") == []


def test_jobs_latest_first_repeats_dropped_shadow_kept_and_bounded() -> None:
    view = FleetView(PREFIX)
    shadow = ShadowFigures(frames=120, agreement=0.97)
    first = job("jet", "j1", JobState.SHADOW, 10.0, shadow=shadow)
    assert view.apply(first)
    assert not view.apply(first)  # the same msg_id again (QoS 1 resend, spool replay)
    view.apply(job("jet", "j2", JobState.FAILED, 11.0, error_code="build_failed", error="boom"))
    view.apply(job("jet", "j1", JobState.ACTIVE, 12.0))
    assert not view.apply(job("jet", "j1", JobState.BUILDING, 9.0))  # an older state arriving late
    jobs = view.device("jet").jobs  # type: ignore[union-attr]
    assert [(j.job_id, j.state) for j in jobs] == [("j1", "ACTIVE"), ("j2", "FAILED")]
    assert jobs[0].shadow is not None
    assert jobs[0].shadow["agreement"] == 0.97
    assert (jobs[1].error_code, jobs[1].error) == ("build_failed", "boom")
    for i in range(MAX_JOBS + 5):
        view.apply(job("jet", f"k{i}", JobState.QUEUED, 20.0 + i))
    jobs = view.device("jet").jobs  # type: ignore[union-attr]
    assert len(jobs) == MAX_JOBS
    assert jobs[0].job_id == f"k{MAX_JOBS + 4}"


def test_malformed_and_foreign_messages_are_named_or_ignored() -> None:
    view = FleetView(PREFIX)
    topics = Topics(PREFIX, "jet")
    assert view.apply(message(topics.info, b"{not json", retain=True))
    assert view.apply(message(topics.telemetry, b'{"ts": 1, "cpu.percent": "hot"}'))
    assert not view.apply(message(topics.info, b"", retain=True))  # a cleared retained topic
    assert not view.apply(message("elsewhere/jet/up/status", b"{}"))
    assert not view.apply(message(topics.results("cam0"), b"{}"))  # not a kind the view keeps
    assert not view.apply(message(f"{PREFIX}/jet/up/status/extra", b"{}"))
    state = view.device("jet")
    assert state is not None
    assert state.problems[0].startswith("info: InfoMessage: payload is not valid JSON")
    assert state.problems[1].startswith("telemetry: ")
    assert state.state == "unknown"


def test_device_text_is_clipped_and_devices_are_capped() -> None:
    view = FleetView(PREFIX, max_devices=2)
    huge = info("jet", version="v" * 100_000)
    view.apply(message(Topics(PREFIX, "jet").info, encode(huge), retain=True))
    assert len(view.device("jet").slots["main"]["version"]) <= 1024  # type: ignore[union-attr]
    view.apply(status("jet-2", "online", 1))
    assert not view.apply(status("jet-3", "online", 1))
    assert [d.device for d in view.devices()] == ["jet", "jet-2"]
    assert view.refused_devices == 1


def test_copies_do_not_change_the_view() -> None:
    view = FleetView(PREFIX)
    view.apply(message(Topics(PREFIX, "jet").info, encode(info("jet", site="lab")), retain=True))
    state = view.device("jet")
    assert state is not None
    state.labels["site"] = "elsewhere"
    state.slots["main"]["version"] = "99"
    again = view.device("jet")
    assert again is not None
    assert (again.labels["site"], again.slots["main"]["version"]) == ("lab", "4")


def test_wait_change_wakes_on_a_change_and_times_out_without_one() -> None:
    view = FleetView(PREFIX)
    version = view.version
    assert view.wait_change(version, timeout=0.05) == version  # nothing happened
    timer = threading.Timer(0.05, lambda: view.apply(status("jet", "online", 1)))
    timer.start()
    try:
        assert view.wait_change(version, timeout=10) == version + 1
    finally:
        timer.join()


def test_changes_tell_new_telemetry_from_other_changes_and_staleness() -> None:
    clock = Clock()
    view = FleetView(PREFIX, stale_after_s=30, clock=clock)
    view.apply(status("jet", "online", 1))
    first = view.changes()["jet"]
    assert first[2] is False  # online, heard just now
    view.apply(telemetry("jet", **{"cpu.percent": 5.0}))
    moved = view.changes()["jet"]
    assert moved[0] > first[0]
    assert moved[1:] == first[1:]  # only new figures: the rest of the device is as it was
    assert view.telemetry("jet") == ({"cpu.percent": 5.0}, clock.now)
    for change in (
        message(Topics(PREFIX, "jet").info, encode(info("jet"))),
        job("jet", "j1", JobState.QUEUED, 1.0),
        message(Topics(PREFIX, "jet").telemetry, b"{not json"),  # a problem line, not figures
        status("jet", "offline", 1),
    ):
        before = view.changes()["jet"]
        view.apply(change)
        after = view.changes()["jet"]
        assert after[0] > before[0]
        assert after[1] > before[1], change.topic
    view.apply(status("jet", "online", 2))
    view.apply(telemetry("jet", **{"cpu.percent": 6.0}))
    before = view.changes()["jet"]
    clock.now += 31  # nothing heard: stale by the clock alone
    assert view.changes()["jet"] == (*before[:2], True)
    assert view.telemetry("nobody") is None
