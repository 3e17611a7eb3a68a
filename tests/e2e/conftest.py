"""Fixtures of the daemon tests: a fresh device id per test, and a probe on its ``up/#``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from agent.localbroker import Broker
from tests.mqtt_probe import Probe


@pytest.fixture
def device_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def probe(broker: Broker, device_id: str) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as p:
        p.subscribe(f"fleet/v1/{device_id}/up/#")
        yield p
