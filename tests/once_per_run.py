"""Set-up whose product is data, made once per parallel run instead of once per pytest-xdist worker.

A module- or session-scoped fixture exists once per worker (docs/testing.md, "Writing a test that
runs beside others"): a module of nine tests sharing a minute of real daemon work, handed out to
four workers, does that work four times. Where the fixture's product is plain data (what a device
published, a file built), the first worker that needs it makes it while holding a lock in the run's
own temporary folder and stores it there; a worker that asks meanwhile waits for the lock, then reads
it. A failed set-up stores nothing: the next worker tries again and fails with its own error. A
serial run makes it as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], bytes]) -> bytes:
    """``make()``'s bytes: made by this worker, or read from the worker of this run that made them."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    run_folder = tmp_path_factory.getbasetemp().parent  # every worker's basetemp is under it
    stored = run_folder / f"{name}.once"
    with _exclusive(run_folder / f"{name}.once-lock"):
        if stored.exists():
            return stored.read_bytes()
        data = make()
        part = stored.with_suffix(".part")
        part.write_bytes(data)
        part.replace(stored)  # whole or absent (a worker killed mid-write leaves only the .part)
        return data
