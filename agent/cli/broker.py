"""``edge-agent broker``: a local mosquitto for trying the agent on one machine, until Ctrl-C.

The broker ``configs/local.yaml`` expects: loopback only, anonymous clients, no persistence, on port
1883 unless ``--port`` says otherwise. It is :class:`agent.localbroker.Broker`, the one the demo and
the tests start, with its config and log in a temporary directory removed at exit. A production
fleet runs a real broker with TLS and ACLs (docs/operations.md).
"""

from __future__ import annotations

import argparse
import signal
import socket
import tempfile
import threading
from pathlib import Path
from types import FrameType

from agent.errors import AgentError
from agent.localbroker import Broker

DEFAULT_PORT = 1883


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edge-agent broker``."""
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default {DEFAULT_PORT})"
    )


def _taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((Broker.host, port)) == 0


def run_broker(port: int, *, stop: threading.Event | None = None) -> int:
    """Run mosquitto on ``127.0.0.1:port`` until SIGINT/SIGTERM (or ``stop``); returns the exit code.

    Raises AgentError when the port is out of range or taken, mosquitto is missing, or it exits.
    """
    if not 1 <= port <= 65535:
        raise AgentError(f"--port {port}: a TCP port is 1..65535")
    if _taken(port):
        raise AgentError(
            f"127.0.0.1:{port} is taken: if it is a broker, the agent can use it as it is; "
            "otherwise stop what listens there, or pass --port"
        )
    if stop is None:
        stop = threading.Event()

        def handler(_signum: int, _frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    with tempfile.TemporaryDirectory(prefix="edge-agent-broker-") as workdir:
        broker = Broker(Path(workdir), port=port)
        try:
            broker.start()
        except RuntimeError as exc:  # mosquitto missing, or it would not start (its log says why)
            raise AgentError(str(exc)) from exc
        print(
            f"mosquitto listening on 127.0.0.1:{port} (anonymous, loopback only); Ctrl-C stops it", flush=True
        )
        try:
            while not stop.wait(0.5):
                if not broker.running:
                    raise AgentError(f"mosquitto exited; its log:\n{broker.log()[-2000:]}")
        finally:
            broker.stop()
    print("mosquitto stopped", flush=True)
    return 0
