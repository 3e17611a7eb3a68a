"""``edge-agent broker``: a local mosquitto on a named port, and one clear line when it cannot be."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from agent.cli import main
from agent.cli.broker import run_broker
from agent.demo.broker import Broker, free_port
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until


def test_runs_on_the_port_until_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    port, stop = free_port(), threading.Event()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_broker(port, stop=stop)), daemon=True)
    thread.start()
    wait_until(lambda: "listening" in capsys.readouterr().out or _accepts(port), timeout=15, what="mosquitto")
    with Probe("127.0.0.1", port) as probe:
        probe.subscribe("local/check")
        assert probe.publish("local/check", b"hi") == 0
    stop.set()
    thread.join(patient(15))
    assert codes == [0]


def _accepts(port: int) -> bool:
    try:
        Probe("127.0.0.1", port, timeout=0.5).close()
    except (TimeoutError, OSError):
        return False
    return True


@pytest.fixture
def not_a_broker() -> Iterator[int]:
    """A TCP listener that accepts and says nothing: a port taken by something other than MQTT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port: int = server.getsockname()[1]
        yield port


@pytest.mark.parametrize("port", ["taken", "0", "70000"])
def test_a_port_it_cannot_use_is_one_line(
    not_a_broker: int, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value = str(not_a_broker) if port == "taken" else port
    assert main(["broker", "--port", value]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: ")
    assert value in err[0]


def test_a_broker_already_on_the_port_is_used_as_it_is(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """A system mosquitto on the port (Debian's lets anonymous loopback clients in): nothing to start,
    exit 0, and the flow's next two commands need no flag."""
    assert main(["broker", "--port", str(broker.port)]) == 0
    out = capsys.readouterr().out
    assert f"127.0.0.1:{broker.port} already has an MQTT broker" in out
    assert "use it as they are" in out
    assert broker.running


def test_a_broker_that_refuses_anonymous_clients_names_the_three_flags(
    broker_factory: Callable[[Sequence[str]], Broker], capsys: pytest.CaptureFixture[str]
) -> None:
    refusing = broker_factory(["allow_anonymous false"])
    assert main(["broker", "--port", str(refusing.port)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "refuses an anonymous client (not authorized)" in line
    for flag in ("edge-agent broker --port ", "EDGE_AGENT__MQTT__PORT=", "--broker 127.0.0.1:"):
        assert flag in line, line
