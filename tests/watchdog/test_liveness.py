"""CallWatch (a real thread blocked on a real lock) and the ``watchdog.stuck_call_s`` setting."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.config import load_config
from agent.errors import ConfigError
from agent.watchdog.liveness import CallWatch
from tests.waiting import patient, wait_until


def test_a_call_is_seen_from_another_thread_while_it_runs_and_not_after() -> None:
    watch = CallWatch()
    assert watch.current() is None
    gate = threading.Lock()
    gate.acquire()

    def blocked_call() -> None:
        watch.enter("read")
        try:
            with gate:  # blocks until the test releases it
                pass
        finally:
            watch.leave()

    worker = threading.Thread(target=blocked_call)
    worker.start()
    wait_until(lambda: watch.over(0.05) is not None, timeout=5.0, what="the call to pass the bound")
    call = watch.current()
    assert call is not None
    assert call.what == "read"
    assert call.seconds > 0.05
    assert watch.over(3600.0) is None  # within a generous bound: not stuck
    gate.release()
    worker.join(patient(5))
    assert watch.current() is None
    assert watch.over(0.0) is None


def _config(tmp_path: Path, watchdog: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(f"device_id: jetson-0001\n{watchdog}")
    return path


def test_the_stuck_call_bound_defaults_to_30_s_and_must_be_positive(tmp_path: Path) -> None:
    assert load_config(_config(tmp_path, ""), {}).watchdog.stuck_call_s == 30.0
    assert load_config(_config(tmp_path, "watchdog: {stuck_call_s: 45}\n"), {}).watchdog.stuck_call_s == 45.0
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, "watchdog: {stuck_call_s: 0}\n"), {})
    assert info.value.problems == ["watchdog.stuck_call_s: must be greater than 0.0"]
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, "watchdog: {stuck_calls: 5}\n"), {})
    assert any(p.startswith("watchdog.stuck_calls") for p in info.value.problems), info.value.problems
