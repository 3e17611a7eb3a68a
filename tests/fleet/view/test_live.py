"""FleetView: the live picture of the fleet, from real messages through a real broker and built ones."""

from __future__ import annotations

import dataclasses
import threading

from agent.demo.broker import Broker
from agent.fleet.base.bounded import cost
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.view.chart_history import POINT_BYTES, ChartHistory
from agent.fleet.view.device_record import (
    FIGURE_NAME_CHARS,
    INFO_BYTES,
    JOB_BYTES,
    MAX_FIGURE_NAME,
    MAX_FIGURES,
    MAX_HISTORY_POINTS,
    MAX_JOBS,
    JobSeen,
)
from agent.fleet.view.live import MAX_DEVICE_ID, FleetView
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.protocol.messages import (
    InfoMessage,
    JobEnd,
    JobState,
    JobStatus,
    ModelRef,
    ProbationFigures,
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
    assert [p.figures["fps"] for p in points] == [3.0, 4.0]
    assert [p.figures["fps"] for p in view.history("jet", since=clock.now - 50)] == [4.0]
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


def test_device_text_is_clipped_and_a_full_view_makes_room_only_from_quiet_devices() -> None:
    clock = Clock()
    view = FleetView(PREFIX, max_devices=2, stale_after_s=60, clock=clock)
    huge = info("jet", version="v" * 100_000)
    view.apply(message(Topics(PREFIX, "jet").info, encode(huge), retain=True))
    assert len(view.device("jet").slots["main"]["version"]) <= 1024  # type: ignore[union-attr]
    clock.now += 1
    view.apply(status("jet-2", "online", 1))
    # Full: "jet" (never online) was heard from longest ago, so the newcomer takes its place.
    assert view.apply(status("jet-3", "online", 1))
    assert [d.device for d in view.devices()] == ["jet-2", "jet-3"]
    # Both online and heard within stale_after_s: a newcomer is refused and counted.
    assert not view.apply(status("jet-4", "online", 1))
    assert view.refused_devices == 1
    # jet-2 stays online but goes silent past stale_after_s: it is the one that makes room.
    clock.now += 59
    view.apply(telemetry("jet-3", **{"cpu.percent": 1.0}))
    clock.now += 2
    assert view.apply(status("jet-4", "online", 1))
    assert [d.device for d in view.devices()] == ["jet-3", "jet-4"]
    assert view.forgotten_devices == 2
    # An id longer than a device id may be is refused, whatever room there is.
    roomy = FleetView(PREFIX)
    assert not roomy.apply(status("j" * (MAX_DEVICE_ID + 1), "online", 1))
    assert (roomy.devices(), roomy.refused_devices) == ([], 1)


def test_refused_devices_are_counted_in_the_metrics() -> None:
    view = FleetView(PREFIX, max_devices=1)
    view.apply(status("jet", "online", 1))
    view.apply(status("jet-2", "online", 1))  # full, and jet is online and fresh: refused
    view.apply(status("j" * (MAX_DEVICE_ID + 1), "online", 1))  # an id too long: refused
    exposition = fleet_metrics(view).render().decode()
    assert "edge_fleet_refused_devices_total 2.0" in exposition


def test_a_cleared_status_forgets_the_device_and_a_cleared_info_forgets_the_info() -> None:
    view = FleetView(PREFIX)
    topics = Topics(PREFIX, "jet")
    view.apply(status("jet", "offline", 1))
    view.apply(message(topics.info, encode(info("jet", site="lab")), retain=True))
    assert view.apply(message(topics.info, b""))  # the retained info cleared
    state = view.device("jet")
    assert state is not None
    assert (state.state, state.labels, state.slots) == ("offline", {}, {})
    version = view.version
    assert view.apply(message(topics.status, b""))  # the retained status cleared
    assert view.device("jet") is None
    assert view.version > version
    assert not view.apply(message(topics.status, b""))  # nothing left to forget
    assert view.forgotten_devices == 1


def test_a_device_offline_past_forget_after_s_leaves_the_view_and_an_online_one_stays() -> None:
    clock = Clock()
    view = FleetView(PREFIX, forget_after_s=3600, clock=clock)
    view.apply(status("gone", "offline", 1))
    view.apply(telemetry("junk", **{"cpu.percent": 1.0}))  # never a status: unknown
    view.apply(status("quiet", "online", 1))  # online, silent: stale, but not forgotten
    clock.now += 3599
    view.apply(status("fresh", "offline", 1))
    assert len(view.devices()) == 4
    clock.now += 61  # the view looks for devices to forget at most once a minute
    assert [d.device for d in view.devices()] == ["fresh", "quiet"]
    assert view.forgotten_devices == 2


def test_a_telemetry_name_of_megabytes_is_left_out_and_named() -> None:
    view = FleetView(PREFIX)
    view.apply(telemetry("jet", **{"n" * 10_000_000: 1.0, "cpu.percent": 5.0}))
    state = view.device("jet")
    assert state is not None
    assert state.telemetry == {"cpu.percent": 5.0}
    assert state.problems == (
        f"telemetry: 1 figure(s) named with over {MAX_FIGURE_NAME} characters left out",
    )


def test_the_latest_telemetry_is_bounded_in_figures_and_name_characters() -> None:
    view = FleetView(PREFIX)
    many = {f"f.{i:06d}": float(i) for i in range(MAX_FIGURES * 3)}
    view.apply(telemetry("jet", **many))
    assert len(view.device("jet").telemetry) == MAX_FIGURES  # type: ignore[union-attr]
    long = {f"{i:05d}" + "x" * (MAX_FIGURE_NAME - 5): 1.0 for i in range(MAX_FIGURES)}
    view.apply(telemetry("jet", **long))
    kept = view.device("jet").telemetry  # type: ignore[union-attr]
    assert sum(map(len, kept)) <= FIGURE_NAME_CHARS
    assert len(kept) == FIGURE_NAME_CHARS // MAX_FIGURE_NAME
    assert f"the first {len(kept)} kept" in view.device("jet").problems[-1]  # type: ignore[union-attr]


def test_the_chart_history_keeps_four_figures_a_point_however_big_the_message() -> None:
    clock = Clock()
    view = FleetView(PREFIX, clock=clock)
    figures = {f"stream.cam{i}.fps": 1.0 for i in range(100)}
    for _ in range(MAX_HISTORY_POINTS + 10):
        view.apply(telemetry("jet", **figures))
        clock.now += 0.5
    points = view.history("jet")
    assert len(points) == MAX_HISTORY_POINTS
    assert points[-1].figures == {"fps": 100.0, "p50_ms": None, "p99_ms": None, "temp_c": None}
    history = ChartHistory(MAX_HISTORY_POINTS)
    for i in range(MAX_HISTORY_POINTS * 3):
        history.add(float(i), figures)
    assert history.nbytes <= 1.25 * MAX_HISTORY_POINTS * POINT_BYTES


def test_an_info_and_a_job_of_megabytes_are_kept_within_their_budgets() -> None:
    view = FleetView(PREFIX)
    big = info("jet").model_copy(update={"platform": {f"k{i}": "v" * 2000 for i in range(5000)}})
    view.apply(message(Topics(PREFIX, "jet").info, encode(big), retain=True))
    state = view.device("jet")
    assert state is not None
    assert state.slots["main"]["version"] == "4"  # slots first: they are kept whole
    assert cost({"slots": state.slots, "labels": state.labels, "platform": state.platform}) <= INFO_BYTES
    assert "info: over the 64 KiB kept per device" in state.problems[0]
    baseline = {f"figure.{i}": float(i) for i in range(100_000)}
    probation = ProbationFigures(elapsed_s=1.0, probation_s=60.0, baseline=baseline)
    view.apply(job("jet", "j" * 5000, JobState.PROBATION, 1.0, probation=probation, error="e" * 100_000))
    seen = view.device("jet").jobs[0]  # type: ignore[union-attr]
    assert len(seen.job_id) <= 1024
    assert seen.error is not None
    assert len(seen.error) <= 1024
    assert seen.probation is not None
    assert cost(dataclasses.asdict(seen)) <= JOB_BYTES + 200  # + the state and time, kept whole


def test_jobs_are_rebuilt_from_the_info_and_from_remembered_jobs() -> None:
    view = FleetView(PREFIX)
    shadow = {"frames": 120, "agreement": 0.97}
    # The rollout store's figures, given before the device is heard (a restarted controller).
    view.remember_jobs("jet", [JobSeen("job-4", "main", "ACTIVE", 5.0, None, None, shadow, None)])
    slots = {
        "main": SlotInfo(
            model=ModelRef(slot="main", model_id="net", version="4", sha256="ab" * 32),
            state="active",
            since=7.0,
            last_job="job-4",
            last_job_state=JobState.ACTIVE,
        ),
        "side": SlotInfo(
            state="empty",
            last_job="job-9",
            last_job_state=JobState.FAILED,
            last_job_error_code="build_failed",
            last_failure=JobEnd(job_id="job-9", state=JobState.FAILED, error_code="build_failed", ts=9.0),
        ),
    }
    retained = info("jet").model_copy(update={"slots": slots})
    view.apply(message(Topics(PREFIX, "jet").info, encode(retained), retain=True))
    jobs = view.device("jet").jobs  # type: ignore[union-attr]
    assert [(j.job_id, j.slot, j.state, j.error_code) for j in jobs] == [
        ("job-9", "side", "FAILED", "build_failed"),
        ("job-4", "main", "ACTIVE", None),
    ]
    assert jobs[1].shadow == shadow
    # A job the device reports itself keeps its own state; the remembered figures fill its gaps.
    view.apply(job("jet", "job-10", JobState.ACTIVE, 20.0))
    view.remember_jobs("jet", [JobSeen("job-10", "main", "SHADOW", 19.0, None, None, shadow, None)])
    latest = view.device("jet").jobs[0]  # type: ignore[union-attr]
    assert (latest.job_id, latest.state, latest.shadow) == ("job-10", "ACTIVE", shadow)


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
