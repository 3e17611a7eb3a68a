"""The ``logs`` command's ring: real structlog and standard-library records through
:func:`configure_logging`, secrets redacted as kept, both bounds, and a follower's cursor."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from agent.fleet.devices.logs import LogCursor
from agent.logs.ring import LogRing, logs_command, redact
from agent.logs.setup import configure_logging
from agent.protocol.command_args import LogsArgs
from agent.protocol.messages import CommandReply


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """configure_logging changes process-wide state: the tests after these must find it as it was."""
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def _ring(lines: int = 100, size: int = 1024 * 1024, format: str = "json") -> tuple[LogRing, io.StringIO]:
    ring = LogRing(lines, size)
    stdout = io.StringIO()
    configure_logging(format, "info", stdout, ring=ring)  # type: ignore[arg-type]
    return ring, stdout


def _texts(ring: LogRing) -> str:
    return "\n".join(line["line"] for line in ring.read(1000)["lines"])


def test_secrets_in_log_lines_are_redacted_as_kept() -> None:
    secret = "hunter2-" + "x" * 6
    ring, stdout = _ring()
    log = structlog.get_logger("test")
    log.info("mqtt.connect", password=secret, url=f"rtsp://admin:{secret}@cam/1", api_token=12345)
    log.warning("http.auth", header=f"Bearer {secret}")
    logging.getLogger("somelib").error("login with password=%s failed", secret)
    key = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE" + secret + "\n-----END EC PRIVATE KEY-----"
    log.error("tls.load", detail=key)
    kept = _texts(ring)
    assert secret not in kept
    assert "12345" not in kept
    assert '"password": "<redacted>"' in kept
    assert "rtsp://***@cam/1" in kept
    assert "Bearer <redacted>" in kept
    assert "password=<redacted>" in kept
    assert "<redacted private key>" in kept
    assert len(ring.read(1000)["lines"]) == 4
    assert secret in stdout.getvalue()  # stdout is left as it was: only the ring (the reply) is redacted
    # Console lines too (no colour codes in the ring).
    ring, _ = _ring(format="console")
    structlog.get_logger("test").info("x", db_password=secret)
    assert secret not in _texts(ring)
    assert "db_password=<redacted>" in _texts(ring)
    assert "\x1b[" not in _texts(ring)


def test_a_redacted_json_line_is_still_json() -> None:
    secret = "s3cr" + "et-value"
    ring, _ = _ring()
    logging.getLogger("somelib").warning("gave up: password=%s", secret)
    logging.getLogger("somelib").warning('retry with token="%s", then stop', secret)
    lines = [json.loads(line["line"]) for line in ring.read(10)["lines"]]
    assert [line["event"] for line in lines] == [
        "gave up: password=<redacted>",
        "retry with token=<redacted>, then stop",
    ]


def test_redact_leaves_plain_lines_alone() -> None:
    line = '{"event": "agent.started", "slots": ["cls"], "frames": 12}'
    assert redact(line) == line


def test_the_ring_keeps_the_latest_lines_within_both_bounds() -> None:
    ring, _ = _ring(lines=10, size=16 * 1024)
    log = structlog.get_logger("test")
    for i in range(25):
        log.info("tick", i=i)
    page = ring.read(100)
    assert [line["seq"] for line in page["lines"]] == list(range(16, 26))
    assert page["last_seq"] == 25
    for i in range(40):
        log.info("big", i=i, blob="y" * 1000)
    assert sum(len(line["line"]) for line in ring.read(100)["lines"]) <= 16 * 1024
    log.info("huge", blob="z" * 50_000)
    [last] = ring.read(1)["lines"]
    assert len(last["line"]) < 8300
    assert "[cut:" in last["line"]


def test_the_command_caps_lines_and_reply_bytes() -> None:
    ring, _ = _ring(lines=1000)
    log = structlog.get_logger("test")
    for i in range(300):
        log.info("tick", i=i, pad="p" * 200)
    assert len(logs_command(ring, lambda: 256 * 1024)(LogsArgs(lines=50))["lines"]) == 50
    small = logs_command(ring, lambda: 8 * 1024)(LogsArgs(lines=1000))
    assert 0 < len(small["lines"]) < 50
    assert small["lines"][-1]["seq"] == 300  # the latest ones


def test_a_follower_gets_each_line_once_and_is_told_of_missed_ones() -> None:
    ring, _ = _ring(lines=10)
    log = structlog.get_logger("test")
    for i in range(5):
        log.info("tick", i=i)
    cursor = LogCursor()

    def poll(lines: int = 1000) -> list[str]:
        page = ring.read(lines, cursor.after)
        printed, _more = cursor.take(CommandReply(command="logs", ok=True, result=page))
        return printed

    assert len(poll(3)) == 3
    assert cursor.after == 5
    assert poll() == []  # nothing new: nothing again
    log.info("tick", i=5)
    assert len(poll()) == 1
    assert not cursor.notes
    for i in range(30):  # 30 new lines into a ring of 10: 20 are gone before the next poll
        log.info("tick", i=100 + i)
    printed = poll()
    assert len(printed) == 10
    assert '"i": 120' in printed[0]
    assert cursor.notes == ["-- 20 line(s) missed: they left the device's log ring before this read --"]
    # A restarted agent: a new boot, numbered from 1 again; the follower starts over, said once.
    restarted = LogRing(10, 1024 * 1024)
    configure_logging("json", "info", io.StringIO(), ring=restarted)
    log.info("after.restart")
    page = restarted.read(1000, cursor.after)
    printed, more = cursor.take(CommandReply(command="logs", ok=True, result=page))
    assert printed == []
    assert more
    assert cursor.after == 0
    assert "restarted" in cursor.notes[-1]
    printed, _ = cursor.take(CommandReply(command="logs", ok=True, result=restarted.read(1000, 0)))
    assert len(printed) == 1
    assert "after.restart" in printed[0]
