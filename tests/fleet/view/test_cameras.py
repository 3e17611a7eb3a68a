"""Each camera of a device as ``fleet status`` and the fleet view show it: its state and last error
from ``up/info``, its fps and last frame's age from ``up/telemetry``, bounded in count and text
whatever the device sends. The device is a plain paho client on a real mosquitto."""

from __future__ import annotations

import json
import threading

from agent.demo.broker import Broker
from agent.fleet.console.summary import device_detail
from agent.fleet.view.cameras import MAX_CAMERAS
from agent.fleet.view.live import FleetView
from agent.fleet.view.status import JSON_TEXT_LIMIT, collect_fleet, format_table
from agent.protocol.messages import (
    CAMERA_ERROR_CHARS,
    CameraInfo,
    InfoMessage,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from tests.fleet.console_rig import DOCK_ERROR, feed
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient

NOW = 1_767_225_600.0
#: What a hostile device puts in a camera's error: a cursor move, a fake table line, and length.
_FAKE_LINE = "\x1b[2J\x1b[Hjet-01  ACTIVE  100%\r"
HOSTILE = _FAKE_LINE + "x" * (CAMERA_ERROR_CHARS - len(_FAKE_LINE))


def _info(device: str, cameras: int, error: str = HOSTILE) -> InfoMessage:
    """``cameras`` cameras: ``cam00`` reconnecting after ``error``, the rest streaming."""
    named = {
        f"cam{i:02d}": CameraInfo(state="streaming", since=NOW - 3600, frames=1000 + i, reconnects=0)
        for i in range(1, cameras)
    }
    named["cam00"] = CameraInfo(
        state="reconnecting",
        since=NOW - 130,
        frames=7,
        reconnects=14,
        last_error=error,
        last_error_at=NOW - 130,
    )
    return InfoMessage(
        device_id=device,
        agent_version="9.9",
        platform={},
        backends={},
        slots={},
        streams=sorted(named),
        cameras=named,
    )


def _telemetry(cameras: int) -> TelemetryMessage:
    values: dict[str, float] = {}
    for i in range(cameras):
        values[f"stream.cam{i:02d}.fps"] = 0.0 if i == 0 else 25.0
        values[f"stream.cam{i:02d}.capture_fps"] = 0.0 if i == 0 else 30.0
        values[f"stream.cam{i:02d}.source.last_frame_age_s"] = 132.0 if i == 0 else 0.03
    return TelemetryMessage.model_validate(values)


def test_fleet_status_shows_each_camera_the_down_ones_with_why_bounded_whatever_the_device_sends(
    broker: Broker,
) -> None:
    prefix = unique_prefix()
    cameras = MAX_CAMERAS + 6
    stop = threading.Event()
    with Probe(broker.host, broker.port) as device:
        topics = Topics(prefix, "jet-a")
        device.publish(
            topics.status, encode(StatusMessage(state="online", session=1, agent_version="9.9")), retain=True
        )
        device.publish(topics.info, encode(_info("jet-a", cameras)), retain=True)

        def send_telemetry() -> None:
            while not stop.wait(0.2):
                device.publish(topics.telemetry, encode(_telemetry(cameras)), qos=0)

        thread = threading.Thread(target=send_telemetry, daemon=True)
        thread.start()
        try:
            rows = collect_fleet(operator_settings(broker, prefix), quiet_s=0.3, telemetry_wait_s=patient(5))
        finally:
            stop.set()
            thread.join(patient(5))

    (row,) = rows
    listed = row.as_dict()["cameras"]
    lines = format_table(rows, now=NOW).splitlines()
    notes = [line for line in lines[2:] if "camera" in line]

    assert len(listed) == MAX_CAMERAS
    assert listed[0]["stream"] == "cam00"
    assert (listed[0]["state"], listed[0]["reconnects"], listed[0]["last_frame_age_s"]) == (
        "reconnecting",
        14,
        132.0,
    )
    assert (listed[1]["capture_fps"], listed[1]["fps"]) == (30.0, 25.0)
    assert all(len(c["last_error"] or "") <= JSON_TEXT_LIMIT for c in listed)
    assert "cam00=reconnecting 0.0fps cam01=streaming 30.0fps" in lines[1]
    assert f"(+{cameras - 8} more)" in lines[1]
    # One line per camera that delivers no frames, with why, escaped and cut: no cursor moves.
    assert len(notes) == 1
    assert notes[0].startswith(
        "jet-a: camera cam00 reconnecting for 2m10s, 14 reconnects, last frame 2m12s ago: "
    )
    assert "\\x1b[2J" in notes[0]
    assert "\x1b" not in "\n".join(lines)
    assert "\r" not in "\n".join(lines)
    assert max(len(line) for line in lines) < 700


def test_the_fleet_view_keeps_at_most_max_cameras_and_the_device_page_merges_their_figures() -> None:
    prefix = unique_prefix()
    view = FleetView(prefix, clock=lambda: NOW)
    topics = Topics(prefix, "jet-a")
    cameras = MAX_CAMERAS + 6
    feed(
        view,
        [
            (topics.status, encode(StatusMessage(state="online", session=1, agent_version="9.9"))),
            (topics.info, encode(_info("jet-a", cameras, error=DOCK_ERROR))),
            (topics.telemetry, encode(_telemetry(cameras))),
        ],
    )
    device = view.device("jet-a")
    assert device is not None
    detail = device_detail(device, view.history("jet-a"))

    assert len(device.cameras) == MAX_CAMERAS
    assert [c["stream"] for c in detail["cameras"]][:2] == ["cam00", "cam01"]
    first = detail["cameras"][0]
    assert (first["state"], first["capture_fps"], first["last_frame_age_s"]) == ("reconnecting", 0.0, 132.0)
    assert first["last_error"] == DOCK_ERROR
    assert not device.problems
    json.dumps(detail)  # what the page is sent: plain JSON


def test_a_camera_error_over_the_protocols_bound_is_refused_with_the_field_named() -> None:
    prefix = unique_prefix()
    view = FleetView(prefix, clock=lambda: NOW)
    topics = Topics(prefix, "jet-a")
    info = json.loads(encode(_info("jet-a", 2)))
    info["cameras"]["cam00"]["last_error"] = "x" * (CAMERA_ERROR_CHARS + 1)
    feed(view, [(topics.info, json.dumps(info).encode())])
    device = view.device("jet-a")

    assert device is not None
    assert device.cameras == {}
    assert any("cameras.cam00.last_error" in p for p in device.problems), device.problems
