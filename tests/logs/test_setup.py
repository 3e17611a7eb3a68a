"""Logging setup, observed from the stdout of a real Python subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import datetime
from typing import Any

import pytest

from agent.logs.setup import configure_logging
from tests.waiting import patient


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _json_lines(stdout: str) -> list[dict[str, Any]]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def test_json_lines_for_structlog_and_stdlib() -> None:
    stdout = _run(
        """
        import logging, structlog
        from agent.logs.setup import configure_logging
        configure_logging("json", "info")
        structlog.get_logger("agent.engine").info("engine.build.done", seconds=1.5, device="dla0")
        structlog.get_logger("agent.engine").debug("engine.build.step")
        logging.getLogger("paho.client").warning("socket %s closed", "tcp")
        logging.getLogger("noisy").debug("hidden")
        """
    )
    records = _json_lines(stdout)
    assert len(records) == 2, stdout

    event = records[0]
    assert event["event"] == "engine.build.done"
    assert event["level"] == "info"
    assert event["logger"] == "agent.engine"
    assert event["seconds"] == 1.5
    assert event["device"] == "dla0"
    stamp = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
    offset = stamp.utcoffset()
    assert offset is not None
    assert offset.total_seconds() == 0

    foreign = records[1]
    assert foreign["event"] == "socket tcp closed"
    assert foreign["level"] == "warning"
    assert foreign["logger"] == "paho.client"
    assert "timestamp" in foreign


def test_configuring_twice_does_not_duplicate_lines_and_applies_the_new_level() -> None:
    stdout = _run(
        """
        import structlog
        from agent.logs.setup import configure_logging
        configure_logging("json", "info")
        configure_logging("json", "debug")
        structlog.get_logger("agent.x").debug("once")
        """
    )
    assert [r["event"] for r in _json_lines(stdout)] == ["once"]


def test_exceptions_are_rendered_inside_the_json_line() -> None:
    stdout = _run(
        """
        import structlog
        from agent.logs.setup import configure_logging
        configure_logging("json", "info")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            structlog.get_logger("agent.x").exception("slot.swap.failed")
        """
    )
    records = _json_lines(stdout)
    assert len(records) == 1
    assert records[0]["level"] == "error"
    assert "RuntimeError: boom" in records[0]["exception"]


def test_warnings_are_routed_to_the_log() -> None:
    stdout = _run(
        """
        import warnings
        from agent.logs.setup import configure_logging
        configure_logging("json", "warning")
        warnings.warn("old option", DeprecationWarning, stacklevel=1)
        """
    )
    records = _json_lines(stdout)
    assert len(records) == 1
    assert records[0]["logger"] == "py.warnings"
    assert "old option" in records[0]["event"]


def test_console_format_is_for_humans() -> None:
    stdout = _run(
        """
        import structlog
        from agent.logs.setup import configure_logging
        configure_logging("console", "info")
        structlog.get_logger("agent.x").info("agent.started", device_id="jetson-1")
        """
    )
    line = stdout.strip()
    assert "agent.started" in line
    assert "device_id=jetson-1" in line
    assert "\x1b[" not in line, "no colour codes when stdout is not a terminal"
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_unknown_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'verbose'"):
        configure_logging("json", "verbose")
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        configure_logging("xml", "info")  # type: ignore[arg-type]


@pytest.mark.parametrize(("cache", "lookups"), [(False, 3), (True, 1)])
def test_cached_loggers_look_their_logger_up_once(cache: bool, lookups: int) -> None:
    """The fleet simulator caches: an uncached event looks its logger up again (logging's global lock)."""
    stdout = _run(
        f"""
        import logging, structlog
        from agent.logs.setup import configure_logging
        configure_logging("json", "info", cache_loggers={cache})
        calls = []
        real = logging.Manager.getLogger
        def counted(self, name):
            calls.append(name)
            return real(self, name)
        logging.Manager.getLogger = counted
        log = structlog.get_logger("agent.sim")
        for n in range(3):
            log.info("tick", n=n)
        print(len([c for c in calls if c == "agent.sim"]))
        """
    )
    *events, count = stdout.splitlines()
    assert [json.loads(line)["n"] for line in events] == [0, 1, 2]
    assert int(count) == lookups
