"""``fleet serve``: a long-running chunk server for every model file in a directory.

Devices ask by SHA-256, so any manifest whose model file lies in the repository is served, whoever
published it. Several ``fleet serve`` processes (on several hosts) share the load through one MQTT 5
shared subscription group (``--group``: a name devices cannot guess; without it each process
serves under a random group of its own). SIGTERM or SIGINT stops it: outstanding chunk publishes
are flushed, the connection is closed, exit code 0.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TextIO

import structlog

from agent.fleet.chunks.server import ChunkServer
from agent.fleet.cli.progress import format_bytes
from agent.mqtt.settings import MqttSettings

log = structlog.get_logger(__name__)

#: How often a line of counters is printed while serving (0: never).
DEFAULT_REPORT_S = 60.0


def serve_repo(
    settings: MqttSettings,
    repo: Path,
    stop: threading.Event,
    *,
    group: str | None = None,
    out: TextIO | None = None,
    report_s: float = DEFAULT_REPORT_S,
    ready: threading.Event | None = None,
) -> ChunkServer:
    """Serve ``repo`` until ``stop`` is set; returns the (stopped) server for its counters.

    ``group`` None serves under a random shared-subscription group of its own. ``ready`` is set
    once the server is subscribed. Raises TransportError when the broker cannot be
    reached at start, ValueError when ``repo`` is not a directory.
    """
    server = ChunkServer(settings, group=group)
    count = server.add_repo(Path(repo))
    server.start()
    try:
        _say(out, f"serving {count} model files from {repo} on {server.topic_filter}")
        if ready is not None:
            ready.set()
        while not stop.wait(report_s if report_s > 0 else 3600.0):
            if report_s > 0:
                _say(out, _counters(server))
    finally:
        server.stop()
    _say(out, "stopped; " + _counters(server))
    return server


def _counters(server: ChunkServer) -> str:
    stats = server.stats()
    return (
        f"requests {stats['requests']}, chunks {stats['chunks']} ({format_bytes(stats['served_bytes'])}), "
        f"unknown model {stats['unknown_model']}, refused {stats['refused']}"
    )


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        out.write(line + "\n")
        out.flush()


def install_stop_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (main thread only)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("fleet.serve.signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
