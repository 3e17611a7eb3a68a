"""Fixtures of the daemon tests: a fresh device id per test, a probe on its ``up/#``, a signing key
and a fleet of agent processes trusting it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from tests.e2e.fleet_rig import Fleet
from tests.mqtt_probe import Probe


@pytest.fixture
def device_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def probe(broker: Broker, device_id: str) -> Iterator[Probe]:
    with Probe(broker.host, broker.port) as p:
        p.subscribe(f"fleet/v1/{device_id}/up/#")
        yield p


@pytest.fixture
def keys(tmp_path: Path) -> KeyPairFiles:
    return write_keypair(tmp_path / "keys", "ops-test")


@pytest.fixture
def fleet(tmp_path: Path, broker: Broker, keys: KeyPairFiles) -> Iterator[Fleet]:
    f = Fleet(tmp_path, broker, keys)
    yield f
    f.close()
