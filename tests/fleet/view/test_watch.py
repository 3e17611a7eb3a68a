"""``edge-agent fleet watch DEVICE``: one device's messages, live, readable or as JSON lines.

The device side is a plain paho client publishing what a device publishes (the protocol models'
own encoding), on the session broker under a prefix of this test.
"""

from __future__ import annotations

import io
import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.view.watch import WatchOptions, watch_device
from agent.protocol.messages import (
    InfoMessage,
    ModelRef,
    ResultMessage,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.results import ClassScore
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

DEVICE = "jet-07"


def _result_message(frame: int, label: str = "circle", stream: str = "lobby") -> ResultMessage:
    return ResultMessage(
        stream=stream,
        frame_index=frame,
        captured_at=1000.0 + frame,
        published_at=1000.01 + frame,
        model=ModelRef(slot="cls", model_id="shapes", version="2", sha256="ab" * 32),
        latency_ms={"preprocess": 0.5, "infer": 2.0, "postprocess": 0.1, "total": 2.6},
        classes=[ClassScore(index=0, label=label, score=0.97)],
    )


def _result(frame: int, label: str = "circle", stream: str = "lobby") -> bytes:
    return encode(_result_message(frame, label, stream))


def _telemetry() -> bytes:
    values: dict[str, Any] = {
        "stream.lobby.fps": 14.9,
        "stream.lobby.latency.total.p50_ms": 3.0,
        "stream.lobby.latency.total.p99_ms": 9.0,
        "process.cpu_percent": 41.0,
        "process.rss_mb": 180.0,
    }
    return encode(TelemetryMessage.model_validate(values))


class Watching:
    """``watch_device`` in a thread, with what it printed."""

    def __init__(self, broker: Broker, prefix: str, options: WatchOptions) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()
        self.stop = threading.Event()
        self.code: int | None = None
        settings = operator_settings(broker, prefix)

        def run() -> None:
            self.code = watch_device(settings, DEVICE, options, self.stop, out=self.out, err=self.err)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        wait_until(lambda: "watching" in self.err.getvalue(), what="the watch to subscribe")

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def finish(self) -> list[str]:
        self.thread.join(patient(10))
        assert not self.thread.is_alive()
        assert self.code == 0
        return self.lines()


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def device(broker: Broker) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as probe:
        yield probe


def test_text_lines_read_like_the_demo_with_one_result_line_per_stream_and_second(
    broker: Broker, prefix: str, device: Probe
) -> None:
    up = f"{prefix}/{DEVICE}/up"
    device.publish(
        f"{up}/status", encode(StatusMessage(state="online", session=3, agent_version="0.1.0")), retain=True
    )
    info = InfoMessage(
        device_id=DEVICE,
        agent_version="0.1.0",
        platform={},
        backends={},
        slots={"cls": SlotInfo(model=_result_message(0).model, state="active")},
        streams=["lobby"],
    )
    watching = Watching(broker, prefix, WatchOptions(every=60.0, count=4))
    device.publish(f"{up}/info", encode(info))
    for frame in range(5):  # five results in well under a second: one line
        device.publish(f"{up}/results/lobby", _result(frame))
    device.publish(f"{up}/telemetry", _telemetry())
    status, info_line, result, telemetry = watching.finish()
    assert status.endswith("status     online (session 3)  (retained)")
    assert info_line.endswith("info       agent 0.1.0; slot cls active: shapes v2; streams: lobby")
    assert "lobby    frame      0  shapes v2  top: circle (0.97)  2.6 ms" in result
    assert "telemetry  lobby 14.9 fps p50 3 ms p99 9 ms | cpu 41% rss 180 MB" in telemetry
    device.publish(f"{up}/status", b"", retain=True)  # clear the retained message


def test_json_prints_every_result_as_one_object_per_line(broker: Broker, prefix: str, device: Probe) -> None:
    up = f"{prefix}/{DEVICE}/up"
    watching = Watching(broker, prefix, WatchOptions(as_json=True, every=60.0, count=4))
    for frame in range(3):
        device.publish(f"{up}/results/lobby", _result(frame))
    device.publish(f"{up}/telemetry", _telemetry())
    documents = [json.loads(line) for line in watching.finish()]
    assert [d["kind"] for d in documents] == ["results", "results", "results", "telemetry"]
    assert [d["payload"]["frame_index"] for d in documents[:3]] == [0, 1, 2]
    assert documents[0]["topic"] == f"{up}/results/lobby"
    assert documents[0]["arg"] == "lobby"
    assert documents[0]["retained"] is False
    assert documents[3]["payload"]["stream.lobby.fps"] == 14.9


def test_a_malformed_message_is_one_line_and_device_text_cannot_move_the_cursor(
    broker: Broker, prefix: str, device: Probe
) -> None:
    up = f"{prefix}/{DEVICE}/up"
    watching = Watching(broker, prefix, WatchOptions(every=0.0, count=3))
    device.publish(f"{up}/results/lobby", b'{"frame_index": "soon"')
    device.publish(f"{up}/results/lobby", _result(1, label="\x1b[2K\rjet-01 ACTIVE"))
    device.publish(f"{up}/nonsense/a/b", b"{}")
    broken, escaped, stray = watching.finish()
    assert "results    malformed: ResultMessage: payload is not valid JSON" in broken
    assert "top: \\x1b[2K\\x0djet-01 ACTIVE (0.97)" in escaped
    assert "\x1b" not in watching.out.getvalue()
    assert "nonsense   malformed:" in stray


def test_json_escapes_device_text_and_reports_malformed_payloads(
    broker: Broker, prefix: str, device: Probe
) -> None:
    up = f"{prefix}/{DEVICE}/up"
    watching = Watching(broker, prefix, WatchOptions(as_json=True, count=2))
    device.publish(f"{up}/telemetry", b'{"ts": 1, "cpu": "hot"}')
    device.publish(f"{up}/results/lobby", _result(1, label="\x1b[31mred"))
    malformed, result = watching.finish()
    assert "\x1b" not in watching.out.getvalue()
    assert json.loads(malformed) == {
        "topic": f"{up}/telemetry",
        "kind": "telemetry",
        "arg": None,
        "retained": False,
        "malformed": "TelemetryMessage: wrong shape: (message): Value error, telemetry field 'cpu' must be a "
        "number, got str",
    }
    assert json.loads(result)["payload"]["classes"][0]["label"] == "\x1b[31mred"


def test_json_cuts_a_long_device_string_at_1024_characters(
    broker: Broker, prefix: str, device: Probe
) -> None:
    up = f"{prefix}/{DEVICE}/up"
    watching = Watching(broker, prefix, WatchOptions(as_json=True, count=1))
    device.publish(f"{up}/results/lobby", _result(1, label="x" * 100_000))
    [line] = watching.finish()
    label = json.loads(line)["payload"]["classes"][0]["label"]
    assert label == "x" * 1021 + "..."


def test_a_quiet_device_gets_one_hint_naming_the_prefix(broker: Broker, prefix: str) -> None:
    watching = Watching(broker, prefix, WatchOptions(duration=5.6))
    assert watching.finish() == []
    hint = [line for line in watching.err.getvalue().splitlines() if line.startswith("nothing from")]
    assert hint == [
        f"nothing from {DEVICE} in 5 s: is it running, on this broker, with prefix {prefix}? "
        "(`edge-agent fleet status` lists devices)"
    ]


@pytest.fixture
def restore_signals() -> Iterator[None]:
    """``fleet watch`` installs SIGINT/SIGTERM handlers; put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.usefixtures("restore_signals")
def test_the_command_prints_json_lines_and_stops_after_count(
    broker: Broker, prefix: str, device: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    up = f"{prefix}/{DEVICE}/up"
    device.publish(
        f"{up}/status", encode(StatusMessage(state="online", session=1, agent_version="0.1.0")), retain=True
    )
    argv = ["fleet", "watch", DEVICE, "--json", "--count", "1", "--broker", f"127.0.0.1:{broker.port}"]
    assert main([*argv, "--prefix", prefix]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["payload"]["state"] == "online"
    device.publish(f"{up}/status", b"", retain=True)


@pytest.mark.usefixtures("restore_signals")
@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["jet/07"], "DEVICE 'jet/07'"),
        (["jet-07", "--every", "-1"], "--every must be a number of seconds, 0 or more"),
        (["jet-07", "--count", "0"], "--count must be 1 or more"),
    ],
)
def test_bad_arguments_get_one_line(
    broker: Broker, argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fleet", "watch", *argv, "--broker", f"127.0.0.1:{broker.port}"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert problem in err[0]
