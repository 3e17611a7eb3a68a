"""Logging setup: structlog for the agent's own events, with the standard library routed through it.

``json`` writes one JSON object per line to stdout (``timestamp``, ``level``, ``event``, ``logger``
and the event's fields), which journald stores and ``journalctl -o cat`` shows verbatim;
``console`` writes aligned, human-readable lines. Records from the standard ``logging`` module
(third-party libraries, ``warnings``) go through the same renderer, so the output has one format.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import Processor

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _AgentHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler configure_logging installs; its type lets a second call find and replace it."""


class RingHandler(logging.Handler):
    """Base of a handler configure_logging adds beside stdout (``ring=``); replaced by the next call."""


def configure_logging(
    format: Literal["json", "console"] = "json",
    level: str = "info",
    stream: TextIO | None = None,
    *,
    cache_loggers: bool = False,
    ring: RingHandler | None = None,
) -> None:
    """Configure structlog and the standard library to write ``format`` lines at ``level`` and above.

    ``stream`` defaults to stdout (journald); tools whose stdout carries data (benchmarks) pass stderr.

    Safe to call again (e.g. after the configuration is reloaded): the previous setup is replaced,
    never duplicated. Raises ``ValueError`` for an unknown format or level.

    ``cache_loggers``: each module's logger is looked up once, not at every event. An uncached
    event takes the standard library's global logging lock (``logging.getLogger``); one agent per
    process never notices, the fleet simulator's 125 devices per process queued on it.

    ``ring``: a second handler that gets the same lines (the agent's :class:`~agent.logs.ring.LogRing`
    for the ``logs`` command); console lines reach it without colour codes.
    """
    try:
        numeric_level = LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}") from None
    if format == "json":
        renderer: list[Processor] = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    elif format == "console":
        renderer = [structlog.dev.ConsoleRenderer(colors=(stream or sys.stdout).isatty())]
    else:
        raise ValueError(f"unknown log format {format!r}; use json or console")

    # Applied to structlog events and to standard-library records alike.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[
            # Drop events below the level before any formatting work is spent on them.
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached by default: structlog.testing.capture_logs() in tests must be able to intercept
        # loggers that were already used, and the agent logs far too rarely for the cache to matter.
        cache_logger_on_first_use=cache_loggers,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _AgentHandler(stream or sys.stdout)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, (_AgentHandler, RingHandler))]:
        root.removeHandler(old)
    root.addHandler(handler)
    if ring is not None:
        plain = renderer if format == "json" else [structlog.dev.ConsoleRenderer(colors=False)]
        ring.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=shared,
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *plain],
            )
        )
        root.addHandler(ring)
    root.setLevel(numeric_level)
    logging.captureWarnings(True)
