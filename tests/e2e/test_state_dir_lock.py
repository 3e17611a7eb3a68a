"""One agent per state directory (issue 20.14): two real ``python -m agent run`` processes on one
state_dir, their configs differing only in ``device_id``; the second exits with one line naming the
first one's pid, and the first keeps running. A SIGKILLed holder leaves no lock behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from agent.demo.broker import Broker
from agent.state.lock import LOCK_FILE_NAME, StateDirBusyError, StateDirLock
from tests.e2e.daemon import REPO, AgentFiles, Daemon
from tests.waiting import patient

pytestmark = pytest.mark.slow


def test_a_second_agent_on_the_same_state_dir_exits_naming_the_first_ones_pid(
    tmp_path: Path, broker: Broker, device_id: str
) -> None:
    files = AgentFiles(tmp_path / "first", broker.port, device_id, frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    files.write_config(stream=stream)
    first = Daemon(files.config_path, tmp_path / "first.log")
    try:
        first.wait_for_event("agent.started", timeout=60)
        copy = yaml.safe_load(files.config_path.read_text())
        copy["device_id"] = f"{device_id}-copy"
        copy_path = tmp_path / "copy.yaml"
        copy_path.write_text(yaml.safe_dump(copy))

        second = subprocess.run(
            [sys.executable, "-m", "agent", "run", "-c", str(copy_path)],
            cwd=REPO,
            check=False,
            capture_output=True,
            text=True,
            timeout=patient(60),
        )

        assert second.returncode == 1, second
        lines = second.stderr.strip().splitlines()
        assert lines == [
            f"error: state directory {files.root / 'state'} is in use by another edge-agent "
            f"(pid {first.proc.pid}); stop that one, or give this one a state_dir of its own"
        ], second.stderr
        assert first.proc.poll() is None  # the first one runs on, untouched
        assert "agent.started" not in second.stdout
    finally:
        code = first.stop()
    assert code == 0, first.log()[-3000:]


def test_the_lock_goes_with_its_process_even_after_sigkill(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from agent.state.lock import StateDirLock
                StateDirLock.acquire({str(tmp_path)!r})
                print("locked", flush=True)
                time.sleep(120)
                """
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StateDirBusyError, match=f"pid {holder.pid}"):
            StateDirLock.acquire(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(patient(10))
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(patient(10))
    assert (tmp_path / LOCK_FILE_NAME).exists()  # the file stays; its lock went with the process
    lock = StateDirLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE_NAME).read_text() == f"{os.getpid()}\n"
    lock.release()
