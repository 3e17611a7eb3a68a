"""``fleet status``: rows from retained status and info, table and JSON."""

from __future__ import annotations

import threading
import time
from typing import Any

from agent.demo.broker import Broker
from agent.fleet.view.status import JSON_TEXT_LIMIT, DeviceRow, age, collect_fleet, format_table, slot_summary
from agent.protocol.messages import (
    InfoMessage,
    JobEnd,
    JobState,
    ModelRef,
    RunsInfo,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient


def test_devices_from_retained_status_and_info(broker: Broker) -> None:
    prefix = unique_prefix()
    a, b = Topics(prefix, "jet-a"), Topics(prefix, "jet-b")
    info = InfoMessage(
        device_id="jet-a",
        agent_version="9.9",
        platform={"device_model": "Orin NX", "jetpack": "6.0", "tensorrt_version": "8.6.2", "dla_cores": 2},
        backends={},
        slots={
            "cls": SlotInfo(
                model=ModelRef(slot="cls", model_id="net", version="4", sha256="ab" * 32),
                state="ACTIVE",
                last_job="job-4",
            ),
            "aux": SlotInfo(state="empty", reason="model file /opt/aux.onnx not found"),
        },
        streams=["cam"],
    )
    with Probe(broker.host, broker.port) as device:
        device.publish(
            a.status, encode(StatusMessage(state="online", session=3, agent_version="9.9")), retain=True
        )
        device.publish(a.info, encode(info), retain=True)
        device.publish(
            b.status, encode(StatusMessage(state="offline", session=1, agent_version="9.8")), retain=True
        )
        device.publish(b.info, b"{not json", retain=True)

    rows = collect_fleet(operator_settings(broker, prefix), quiet_s=0.3)

    assert [r.device for r in rows] == ["jet-a", "jet-b"]
    jet_a, jet_b = rows
    assert (jet_a.state, jet_a.session, jet_a.agent_version) == ("online", 3, "9.9")
    assert jet_a.slots["cls"]["version"] == "4"
    assert (jet_b.state, jet_b.agent_version) == ("offline", "9.8")
    assert jet_b.problems
    assert jet_b.problems[0].startswith("info:")
    table = format_table(rows, now=time.time())
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["DEVICE", "STATUS"]
    assert "cls=net:4" in lines[1]
    assert "aux=empty" in lines[1]  # not "aux=-:-"
    assert "jet-a: slot aux is empty: model file /opt/aux.onnx not found" in lines
    assert "cls=job-4" in lines[1]
    assert "Orin NX, JetPack 6.0, TRT 8.6.2, 2 DLA" in lines[1]
    assert lines[2].startswith("jet-b")
    assert " offline " in lines[2]
    assert jet_a.as_dict()["slots"]["cls"]["last_job"] == "job-4"


def test_age() -> None:
    assert [age(s) for s in (5, 125, 7300, 90000)] == ["5s", "2m05s", "2h01m", "1d01h"]


def test_last_job_with_its_end_last_failure_and_telemetry_figures(broker: Broker) -> None:
    prefix = unique_prefix()
    failed_at = 1_700_000_000.0
    failure = JobEnd(
        job_id="job-5", state=JobState.REJECTED, error_code="unsigned", error="sign it", ts=failed_at
    )
    info = InfoMessage(
        device_id="jet-a",
        agent_version="9.9",
        platform={},
        backends={},
        slots={
            "cls": SlotInfo(
                model=ModelRef(slot="cls", model_id="net", version="4", sha256="ab" * 32),
                state="ACTIVE",
                last_job="job-5",
                last_job_state=JobState.REJECTED,
                last_job_error_code="unsigned",
                last_failure=failure,
            )
        },
        streams=["cam"],
    )
    telemetry = {
        "jet-a": {"stream.cam.fps": 20.0, "stream.door.fps": 4.5, "cpu.percent": 37.2, "temp.cpu_c": 48.0,
                  "temp.gpu_c": 52.4},
        "jet-b": {"stream.cam.fps": 1e308, "cpu.percent": 1e300},  # finite, so valid: must not print wide
    }  # fmt: skip
    stop = threading.Event()
    with Probe(broker.host, broker.port) as device:
        for name in ("jet-a", "jet-b", "jet-quiet"):
            status = StatusMessage(state="online", session=1, agent_version="9.9")
            device.publish(Topics(prefix, name).status, encode(status), retain=True)
        device.publish(Topics(prefix, "jet-a").info, encode(info), retain=True)

        def send_telemetry() -> None:
            # As agents do (every telemetry.interval_s; faster here), not retained.
            while not stop.wait(0.2):
                for name, values in telemetry.items():
                    message = encode(TelemetryMessage.model_validate(values))
                    device.publish(Topics(prefix, name).telemetry, message, qos=0)

        thread = threading.Thread(target=send_telemetry, daemon=True)
        thread.start()
        try:
            rows = collect_fleet(operator_settings(broker, prefix), quiet_s=0.3, telemetry_wait_s=2.0)
        finally:
            stop.set()
            thread.join(patient(5))

    jet_a, jet_b, quiet = rows
    assert (jet_a.fps, jet_a.cpu_percent, jet_a.temp_c) == (24.5, 37.2, 52.4)
    assert (quiet.fps, quiet.cpu_percent, quiet.telemetry_at) == (None, None, None)
    assert jet_b.fps == 1e308
    assert jet_a.as_dict()["slots"]["cls"]["last_failure"]["error_code"] == "unsigned"
    lines = format_table(rows, now=failed_at + 120).splitlines()
    header = lines[0].split("  ")
    assert [h.strip() for h in header if h.strip()][:6] == ["DEVICE", "STATUS", "AGENT", "FPS", "CPU", "TEMP"]
    assert " 24.5 " in lines[1]
    assert " 37% " in lines[1]
    assert " 52C " in lines[1]
    assert "cls=job-5 REJECTED unsigned" in lines[1]
    assert "cls=unsigned 2m00s ago" in lines[1]
    assert " 1e+308 " in lines[2]
    assert max(len(line) for line in lines) < 300
    assert lines[3].split()[4:7] == ["-", "-", "-"]  # jet-quiet online 2m00s 9.9 - - -


def test_an_online_devices_info_that_comes_after_a_pause_is_waited_for(broker: Broker) -> None:
    """No end marker comes with retained messages: a quiet pause once ended the collection, and a
    large info on a loaded host came after it (the row had no platform). An online device's info is
    waited for, up to the bounded total wait; a device that never sends one costs that wait only."""
    prefix = unique_prefix()
    late, mute = Topics(prefix, "jet-late"), Topics(prefix, "jet-mute")
    info = InfoMessage(
        device_id="jet-late",
        agent_version="9.9",
        platform={"device_model": "Orin NX"},
        backends={},
        slots={},
        streams=[],
    )
    rows: list[Any] = []
    with Probe(broker.host, broker.port) as device:
        device.publish(
            late.status, encode(StatusMessage(state="online", session=1, agent_version="9.9")), retain=True
        )
        collector = threading.Thread(
            target=lambda: rows.extend(
                collect_fleet(operator_settings(broker, prefix), quiet_s=0.2, max_wait_s=30)
            )
        )
        collector.start()
        time.sleep(1.0)  # five quiet periods: the collection would have ended here
        device.publish(late.info, encode(info), retain=True)
        collector.join(patient(30))
        assert [(r.device, r.platform.get("device_model")) for r in rows] == [("jet-late", "Orin NX")]

        # A device online without an info costs the bounded wait, no more.
        device.publish(
            mute.status, encode(StatusMessage(state="online", session=1, agent_version="9.9")), retain=True
        )
        started = time.monotonic()
        mute_rows = collect_fleet(operator_settings(broker, prefix), quiet_s=0.2, max_wait_s=1.0)
        assert time.monotonic() - started < 30
        assert {r.device: r.info_seen for r in mute_rows} == {"jet-late": True, "jet-mute": False}


def test_what_each_slot_runs_is_a_column_and_a_fallback_a_line_with_its_reason_whatever_its_size() -> None:
    """Straight from up/info's ``runs``: the RUNS column, and a line per fallback, bounded."""
    guard = "INT8 accuracy guard: INT8 top-1 agrees with FP32 on 18.8% of 64 held-out frames"
    info = InfoMessage(
        device_id="jet-a",
        agent_version="1",
        platform={},
        backends={},
        slots={
            "cls": SlotInfo(
                model=ModelRef(slot="cls", model_id="net", version="4", sha256="ab" * 32),
                state="active",
                runs=RunsInfo(requested="int8", precision="fp32", source="built", fallback=guard),
            ),
            "det": SlotInfo(
                model=ModelRef(slot="det", model_id="yolo", version="2", sha256="cd" * 32),
                state="active",
                runs=RunsInfo(requested="int8", source="interim"),
            ),
            "hog": SlotInfo(
                model=ModelRef(slot="hog", model_id="x", version="1", sha256="ef" * 32),
                state="active",
                runs=RunsInfo(
                    requested="i" * 5000, precision="p\x1b[2J" * 5000, source="built", fallback="w" * 50_000
                ),
            ),
        },
        streams=[],
    )
    row = DeviceRow("jet-a", state="online", slots=slot_summary(info))
    lines = format_table([row], now=time.time()).splitlines()
    assert "RUNS (precision, engine)" in lines[0]
    assert "cls=fp32 built, int8 asked" in lines[1]
    assert "det=interim, int8 builds" in lines[1]
    assert f"jet-a: slot cls runs fp32, int8 asked: {guard}" in lines
    assert all("\x1b" not in line and len(line) < 700 for line in lines)
    assert row.as_dict()["slots"]["cls"]["runs"] == {
        "requested": "int8",
        "precision": "fp32",
        "source": "built",
        "fallback": guard,
    }
    assert len(row.as_dict()["slots"]["hog"]["runs"]["fallback"]) <= JSON_TEXT_LIMIT
