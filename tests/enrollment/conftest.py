"""Fixtures of the device's enrollment tests: a fleet CA, a claim and a broker with both TLS listeners."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from tests.enrollment.fleet_pki import FleetPki, StandInDesk, make_fleet_pki


@pytest.fixture
def fleet_pki(tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker]) -> FleetPki:
    return make_fleet_pki(tmp_path / "fleet", broker_factory)


@pytest.fixture
def desk(fleet_pki: FleetPki) -> Iterator[StandInDesk]:
    """The stand-in desk (the real CA API answering); a test sets ``desk.decide`` to script it."""
    made = StandInDesk(fleet_pki)
    yield made
    made.stop()
