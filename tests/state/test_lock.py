"""Who holds a state directory: `edge-agent import` signals that agent, and nobody when none runs."""

from __future__ import annotations

import os
from pathlib import Path

from agent.state.lock import StateDirLock, holder_pid


def test_the_holder_is_the_process_holding_the_lock_and_nobody_once_it_let_go(tmp_path: Path) -> None:
    assert holder_pid(tmp_path) is None  # no lock file yet
    lock = StateDirLock.acquire(tmp_path)
    try:
        assert holder_pid(tmp_path) == os.getpid()
    finally:
        lock.release()
    assert holder_pid(tmp_path) is None  # the file stays, the lock is gone
    assert StateDirLock.acquire(tmp_path) is not None  # and holder_pid took no lock of its own
