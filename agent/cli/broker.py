"""``edge-agent broker``: a local mosquitto for trying the agent on one machine, until Ctrl-C.

The broker ``configs/local.yaml`` expects: loopback only, anonymous clients, no persistence, on port
1883 unless ``--port`` says otherwise. It is :class:`agent.demo.broker.Broker`, the one the demo and
the tests start, with its config and log in a temporary directory removed at exit. A production
fleet runs a real broker with TLS and ACLs (docs/operations.md).

When the port already has a broker that lets an anonymous loopback client in (a system mosquitto,
which Debian's package starts on 127.0.0.1:1883 with exactly that configuration), there is nothing
to start: the agent and ``fleet watch`` use that one as they are, so the command says so and exits 0
instead of sending the user to three flags. Anything else on the port is an error naming them.
"""

from __future__ import annotations

import argparse
import signal
import socket
import tempfile
import threading
from pathlib import Path
from types import FrameType

from agent.demo.broker import Broker, free_port
from agent.errors import AgentError

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


#: MQTT 3.1.1 CONNECT: clean session, keep-alive 10 s, an empty client id (the broker assigns one),
#: no user name. Every MQTT 5 broker accepts 3.1.1 too; one packet needs no client library thread.
_CONNECT = bytes([0x10, 12, 0, 4]) + b"MQTT" + bytes([4, 0x02, 0, 10, 0, 0])
_DISCONNECT = bytes([0xE0, 0])
_CONNACK_REASONS = {1: "protocol version refused", 2: "client id refused", 3: "server unavailable"}
_CONNACK_REASONS |= {4: "bad user name or password", 5: "not authorized"}


def _anonymous_connect(port: int, timeout_s: float = 3.0) -> str | None:
    """None when an MQTT broker on 127.0.0.1:port accepts an anonymous client; else what happened."""
    try:
        with socket.create_connection((Broker.host, port), timeout=timeout_s) as sock:
            sock.sendall(_CONNECT)
            answer = b""
            while len(answer) < 4:
                chunk = sock.recv(4 - len(answer))
                if not chunk:
                    break
                answer += chunk
            if len(answer) < 4 or answer[0] != 0x20 or answer[1] != 2:
                return "it does not answer as an MQTT broker"
            if answer[3] != 0:
                reason = _CONNACK_REASONS.get(answer[3], f"return code {answer[3]}")
                return f"an MQTT broker refuses an anonymous client ({reason})"
            sock.sendall(_DISCONNECT)
            return None
    except OSError as exc:
        return f"it does not answer as an MQTT broker ({exc})"


def run_broker(port: int, *, stop: threading.Event | None = None) -> int:
    """Run mosquitto on ``127.0.0.1:port`` until SIGINT/SIGTERM (or ``stop``); returns the exit code.

    Returns 0 at once when a broker that lets anonymous clients in already listens there. Raises
    AgentError when the port is out of range or taken by anything else, mosquitto is missing, or it exits.
    """
    if not 1 <= port <= 65535:
        raise AgentError(f"--port {port}: a TCP port is 1..65535")
    if _taken(port):
        problem = _anonymous_connect(port)
        if problem is None:
            print(
                f"127.0.0.1:{port} already has an MQTT broker that lets anonymous loopback clients in "
                "(a system mosquitto?): `edge-agent run` and `edge-agent fleet watch` use it as they are; "
                "nothing to start",
                flush=True,
            )
            return 0
        other = free_port()  # free a moment ago: a port the user can take
        raise AgentError(
            f"127.0.0.1:{port} is taken and {problem}: stop what listens there, or use another port "
            f"in all three commands: `edge-agent broker --port {other}`, "
            f"`EDGE_AGENT__MQTT__PORT={other} edge-agent run -c configs/local.yaml`, "
            f"`edge-agent fleet watch local-01 --broker 127.0.0.1:{other}`"
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
