"""Shared fixtures: real mosquitto brokers on free loopback ports; the run lock of ``alone`` tests;
every process the run starts ended with it (tests/run_processes.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from tests import run_processes


@contextlib.contextmanager
def _flock(path: Path, operation: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


def pytest_configure(config: pytest.Config) -> None:
    """Record every child of this pytest process from now on (tests/run_processes.py)."""
    run_processes.start()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over, passed, failed or interrupted: end what it started and still runs."""
    run_processes.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist: ``slow`` tests first, ``alone`` tests last (docs/testing.md, "The order").

    A worker takes the next test of this order whenever it is free, so a test of a minute started
    last keeps the run waiting while the other workers idle; started first, it runs beside the
    short ones. An ``alone`` test waits for every running test to end before it starts: at the end
    it waits for short ones. A serial run, or one with ``EDGE_AGENT_TEST_ORDER=files``, keeps the
    order of the files.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ or os.environ.get("EDGE_AGENT_TEST_ORDER") == "files":
        return

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("alone") is not None:
            return 2
        return 0 if item.get_closest_marker("slow") is not None else 1

    items.sort(key=rank)  # stable: files and their tests keep their order within a rank


@pytest.fixture(autouse=True)
def _run_lock(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, every test holds the run's lock shared; an ``alone`` test holds it alone.

    A fair reader/writer lock between the run's workers (docs/testing.md): the turnstile makes
    tests that arrive after an ``alone`` test queue behind it, so it never waits forever for a gap.
    The lock files live in the run's own temporary folder (the parent of each worker's), so two
    runs on one machine do not wait for each other. A serial run has nothing to lock against.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run_folder = tmp_path_factory.getbasetemp().parent
    turnstile, tests = run_folder / "alone.turnstile", run_folder / "alone.tests"
    if request.node.get_closest_marker("alone") is not None:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(tests, fcntl.LOCK_EX):
            yield
        return
    with contextlib.ExitStack() as held:
        with _flock(turnstile, fcntl.LOCK_EX):
            held.enter_context(_flock(tests, fcntl.LOCK_SH))
        yield


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
