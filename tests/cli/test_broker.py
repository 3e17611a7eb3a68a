"""``edge-agent broker``: a local mosquitto on a named port, and one clear line when it cannot be."""

from __future__ import annotations

import threading

import pytest

from agent.cli import main
from agent.cli.broker import run_broker
from agent.localbroker import Broker, free_port
from tests.mqtt_probe import Probe
from tests.waiting import wait_until


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
    thread.join(15)
    assert codes == [0]


def _accepts(port: int) -> bool:
    try:
        Probe("127.0.0.1", port, timeout=0.5).close()
    except (TimeoutError, OSError):
        return False
    return True


@pytest.mark.parametrize("port", ["taken", "0", "70000"])
def test_a_port_it_cannot_use_is_one_line(
    broker: Broker, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    value = str(broker.port) if port == "taken" else port
    assert main(["broker", "--port", value]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: ")
    assert value in err[0]
