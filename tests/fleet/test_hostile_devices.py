"""The operator side survives what devices send: ``fleet status`` and ``fleet deploy`` run for real
(through ``edge-agent``'s entry function) against a real mosquitto while a paho probe plays devices
that publish hostile messages: non-finite times, oversized counts, escape sequences that would draw a
fake line, a 20 MB field, and a malformed job status and ``status`` reply in the middle of a deploy.

Each hostile message is reported for its device (device and field named) and nothing else breaks:
no traceback, no control character on the terminal, bounded output, the right exit code.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.deploy_command import EXIT_FAILED, EXIT_MALFORMED
from agent.localbroker import Broker
from agent.protocol.messages import CommandReply, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import announce, tiny_model, unique_prefix
from tests.mqtt_probe import Probe

#: What an attacker's escape sequence tries to draw over the real progress or table.
FAKE_LINE = "jet-01  ACTIVE      100%  4.0 KiB / 4.0 KiB"
#: Cursor up, erase line, carriage return, then the fake line; a bidi override and a backspace.
ESCAPES = f"\x1b[1A\x1b[2K\r{FAKE_LINE}\n{FAKE_LINE}\x9b2K\u202e\b"
_BIG = 20 * 1024 * 1024


def _status(ts: str, session: str = "1") -> bytes:
    return f'{{"state": "online", "session": {session}, "agent_version": "1.0", "ts": {ts}}}'.encode()


def _info(
    device: str, *, agent_version: str = "1.0", model_id: str = "net", slot: str = "cls", **platform: str
) -> bytes:
    return json.dumps(
        {
            "device_id": device,
            "agent_version": agent_version,
            "platform": {"device_model": "Orin NX", **platform},
            "backends": {},
            "slots": {
                slot: {
                    "model": {"slot": slot, "model_id": model_id, "version": "4", "sha256": "ab" * 32},
                    "state": "ACTIVE",
                    "last_job": f"job-{model_id}",
                }
            },
            "streams": [],
        }
    ).encode()


#: device -> (retained status payload, retained info payload or None, what the operator must be told).
STATUS_TABLE: dict[str, tuple[bytes, bytes | None, str | None]] = {
    "jet-nan": (
        _status("NaN"),
        None,
        "status: StatusMessage: wrong shape: ts: Input should be a finite number",
    ),
    "jet-inf": (_status("Infinity"), None, "ts: Input should be a finite number"),
    "jet-ninf": (_status("-Infinity"), None, "ts: Input should be a finite number"),
    "jet-1e400": (_status("1e400"), None, "ts: Input should be a finite number"),
    "jet-session": (
        _status("1.7e9", "1" + "0" * 30),
        None,
        "session: Input should be less than or equal to",
    ),
    "jet-esc": (
        _status("1.7e9"),
        _info("jet-esc", agent_version=ESCAPES, model_id=ESCAPES, slot="c\bls", jetpack=ESCAPES),
        None,
    ),
    "jet-huge": (_status("1.7e9"), _info("jet-huge", device_model="A" * _BIG), None),
    "jet-ok": (_status("1.7e9"), _info("jet-ok"), None),
}


def _assert_terminal_safe(text: str) -> None:
    """Only printable characters and newlines, and no line an attacker drew."""
    bad = {c for c in text if c != "\n" and unicodedata.category(c) in {"Cc", "Cf", "Zl", "Zp", "Cs"}}
    assert not bad, f"control characters reached the terminal: {sorted(map(ascii, bad))}"
    drawn = [line for line in text.splitlines() if re.match(r"\s*jet-01\b", line)]
    assert not drawn, f"a device drew lines of its own: {drawn}"


def _broker_args(broker: Broker, prefix: str) -> list[str]:
    return ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]


@pytest.fixture
def hostile_fleet(broker: Broker) -> str:
    """A prefix under which every device of STATUS_TABLE has its retained status (and info)."""
    prefix = unique_prefix()
    with Probe(broker.host, broker.port) as device:
        for name, (status, info, _) in STATUS_TABLE.items():
            device.publish(Topics(prefix, name).status, status, retain=True)
            if info is not None:
                device.publish(Topics(prefix, name).info, info, retain=True, timeout=30)
    return prefix


def test_fleet_status_table_reports_each_hostile_device_and_prints_nothing_raw(
    broker: Broker, hostile_fleet: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "fleet",
            "status",
            "--retained-wait",
            "10",
            "--telemetry-wait",
            "0",
            *_broker_args(broker, hostile_fleet),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    _assert_terminal_safe(out + err)
    rows = {line.split()[0] for line in out.splitlines()[1:] if not re.match(r"jet-[\w-]+: malformed", line)}
    assert rows == set(STATUS_TABLE)
    for device, (_, _, told) in STATUS_TABLE.items():
        if told is not None:
            assert any(
                line.startswith(f"{device}: malformed ") and told in line for line in out.splitlines()
            ), device
    # The escapes are shown, visibly: the operator sees that the device sent them.
    assert "\\x1b[1A\\x1b[2K\\x0d" in out
    # A 20 MB platform field costs a table cell, not 20 MB (or 60 MB) of output.
    assert len(out) < 8192, len(out)


def test_fleet_status_json_is_valid_and_bounded(
    broker: Broker, hostile_fleet: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "fleet",
            "status",
            "--json",
            "--retained-wait",
            "10",
            "--telemetry-wait",
            "0",
            *_broker_args(broker, hostile_fleet),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    rows = {row["device"]: row for row in json.loads(out, parse_constant=refuse)}
    assert set(rows) == set(STATUS_TABLE)
    assert rows["jet-nan"]["since"] is None
    assert "ts: Input should be a finite number" in rows["jet-nan"]["problems"][0]
    assert len(out) < 64 * 1024, len(out)
    assert rows["jet-huge"]["platform"]["device_model"].endswith("...")


def _play_devices(
    probe: Probe, prefix: str, devices: dict[str, Callable[[str], list[bytes]]], bad_status_reply: str | None
) -> threading.Thread:
    """Each device publishes its job messages once it sees its manifest; ``bad_status_reply``
    answers the deploy's ``status`` commands with a last_job record whose ``error_code`` is a number."""
    announce(probe, prefix, *devices)  # connected devices: the deploy knows them
    probe.subscribe(f"{prefix}/+/down/desired/cls")
    if bad_status_reply is not None:
        probe.subscribe(Topics(prefix, bad_status_reply).cmd("status"))

    def run() -> None:
        manifests = probe.wait_for(
            lambda ms: sum(1 for m in ms if m.topic.endswith("/down/desired/cls")) >= len(devices), timeout=20
        )
        for message in manifests:
            if not message.topic.endswith("/down/desired/cls"):
                continue
            device = message.topic.split("/")[2]
            job_id = json.loads(json.loads(message.payload)["manifest"])["job_id"]
            for payload in devices[device](job_id):
                probe.publish(Topics(prefix, device).jobs(job_id), payload)
        if bad_status_reply is None:
            return
        topics = Topics(prefix, bad_status_reply)
        request = probe.wait_for_count(topics.cmd("status"), 1, timeout=20)[0]
        record = {"job_id": job_id, "state": "FAILED", "error_code": 12345}
        reply = CommandReply(
            command="status", ok=True, result={"delivery": {"slots": {"cls": {"last_job": record}}}}
        )
        probe.publish(request.response_topic or "", encode(reply), correlation_data=request.correlation_data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _job(state: str, *, ts: str = "1.7e9", **fields: object) -> Callable[[str], bytes]:
    extra = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
    return lambda job_id: (
        f'{{"job_id": "{job_id}", "slot": "cls", "state": "{state}", "ts": {ts}{extra}}}'.encode()
    )


def _deploy(tmp_path: Path, broker: Broker, prefix: str, devices: str, timeout: float) -> int:
    model = tiny_model(tmp_path / "net.onnx")
    return main(
        [
            "fleet", "deploy", str(model), "--device", devices, "--slot", "cls", "--version", "3",
            "--unsigned", "--chunk-size", "4096", "--no-serve", "--timeout", str(timeout),
            "--status-poll", "0.3", *_broker_args(broker, prefix),
        ]
    )  # fmt: skip


def test_deploy_reports_a_malformed_device_and_goes_on(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    scripts: dict[str, Callable[[str], list[bytes]]] = {
        "jet-ok": lambda j: [_job("QUEUED")(j), _job("ACTIVE")(j)],
        # A job status whose error_code is a number, then (asked with `status`) a reply just as bad.
        "jet-bad": lambda j: [_job("QUEUED")(j), _job("FAILED", error_code=12345, error="x")(j)],
    }
    with Probe(broker.host, broker.port) as probe:
        thread = _play_devices(probe, prefix, scripts, bad_status_reply="jet-bad")
        code = _deploy(tmp_path, broker, prefix, "jet-ok,jet-bad", timeout=4)
        thread.join(5)
    out, err = capsys.readouterr()
    assert code == EXIT_MALFORMED, out + err
    _assert_terminal_safe(out + err)
    assert (
        "jet-bad: malformed jobs message: JobStatus: wrong shape: error_code: Input should be a valid string"
        in err
    )
    assert (
        "jet-bad: malformed status reply: result.delivery.slots.cls.last_job.error_code: "
        "Input should be a valid string" in err
    )
    assert "jet-bad: still QUEUED when the deploy stopped waiting" in err
    assert re.search(r"^jet-ok\s+ACTIVE", out, re.MULTILINE)


def test_deploy_shows_hostile_device_text_escaped_and_capped(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    scripts: dict[str, Callable[[str], list[bytes]]] = {
        "jet-evil": lambda j: [
            _job("QUEUED")(j),
            _job("REJECTED", error_code=ESCAPES, error=ESCAPES + "E" * 1_000_000)(j),
        ],
        # Times that are not numbers: the first two are refused (and reported), the last one counts.
        "jet-nan": lambda j: [_job("QUEUED", ts="NaN")(j), _job("ACTIVE", ts="1e400")(j), _job("ACTIVE")(j)],
    }
    with Probe(broker.host, broker.port) as probe:
        thread = _play_devices(probe, prefix, scripts, bad_status_reply=None)
        code = _deploy(tmp_path, broker, prefix, "jet-evil,jet-nan", timeout=20)
        thread.join(5)
    out, err = capsys.readouterr()
    assert code == EXIT_FAILED, out + err
    _assert_terminal_safe(out + err)
    assert "jet-evil: REJECTED \\x1b[1A\\x1b[2K\\x0djet-01" in err
    assert (
        "jet-nan: malformed jobs message: JobStatus: wrong shape: ts: Input should be a finite number" in err
    )
    assert re.search(r"^jet-nan\s+ACTIVE", out, re.MULTILINE)
    assert len(out) + len(err) < 8192, len(out) + len(err)


def test_fleet_cmd_prints_a_hostile_reply_as_valid_escaped_json(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-evil")
    with Probe(broker.host, broker.port) as device:
        device.subscribe(topics.cmd("status"))

        def answer() -> None:
            request = device.wait_for_count(topics.cmd("status"), 1, timeout=20)[0]
            text = json.dumps(ESCAPES)
            reply = (
                f'{{"command": "status", "ok": true, "result": {{"t": NaN, "u": -Infinity, "s": {text}}}}}'
            )
            device.publish(
                request.response_topic or "", reply.encode(), correlation_data=request.correlation_data
            )

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        code = main(["fleet", "cmd", "jet-evil", "status", *_broker_args(broker, prefix)])
        thread.join(5)
    out, err = capsys.readouterr()
    assert code == 0, err
    _assert_terminal_safe(out + err)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    result = json.loads(out, parse_constant=refuse)["result"]
    assert result == {"t": None, "u": None, "s": ESCAPES}  # the text itself, escaped only in the JSON
