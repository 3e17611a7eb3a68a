"""Fixtures of the transfer tests: a :class:`~tests.delivery.transfer.transfer_rig.Rig` per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from tests.delivery.transfer.transfer_rig import Rig


@pytest.fixture
def rig(broker: Broker, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(broker, tmp_path)
    yield r
    r.close()
