"""Shared fixtures: real mosquitto brokers on free loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.localbroker import Broker


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker shared by the whole session: do not stop, restart or reconfigure it.

    Use a unique topic (or device id) per test so tests sharing it cannot see each other.
    """
    b = Broker(tmp_path_factory.mktemp("broker-shared"))
    b.start()
    yield b
    b.kill()


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker for one test, which may kill, stop or restart it."""
    b = Broker(tmp_path / "broker")
    b.start()
    yield b
    b.kill()


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[[Sequence[str]], Broker]]:
    """Call with extra mosquitto config lines to get a started private broker; all killed at teardown."""
    started: list[Broker] = []

    def make(extra_config: Sequence[str] = ()) -> Broker:
        b = Broker(tmp_path / f"broker-{len(started)}", extra_config)
        started.append(b)
        b.start()
        return b

    yield make
    for b in started:
        b.kill()
