"""The broker fixture itself: start, restart on the same port, extra config lines."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from agent.demo.broker import Broker
from tests.mqtt_probe import Probe


def test_shared_broker_round_trip(broker: Broker) -> None:
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe("fixture/round-trip")
        assert probe.publish("fixture/round-trip", b"hello") == 0
        [msg] = probe.wait_for_count("fixture/round-trip", 1)
        assert msg.payload == b"hello"


def test_restart_keeps_port(private_broker: Broker) -> None:
    port = private_broker.port
    private_broker.restart(hard=True)
    assert private_broker.port == port
    assert private_broker.running
    with Probe(private_broker.host, port) as probe:
        probe.subscribe("fixture/after-restart")


def test_factory_applies_extra_config(broker_factory: Callable[[Sequence[str]], Broker]) -> None:
    b = broker_factory(["allow_anonymous false"])
    # Later lines win in mosquitto's config: anonymous clients are now refused.
    with pytest.raises(TimeoutError):
        Probe(b.host, b.port, timeout=1.0)
