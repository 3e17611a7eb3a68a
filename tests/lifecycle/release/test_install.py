"""The install's bound: pip (or venv) stopped when the install's time runs out or the job is cancelled."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from agent.lifecycle.release.install import run_bounded
from agent.protocol.delivery_errors import AgentInstallFailedError, JobCancelledError
from tests.waiting import patient

HANGS = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_step_that_outlasts_the_install_time_is_killed_and_fails_the_install() -> None:
    with pytest.raises(AgentInstallFailedError, match="pip took longer than the install may take"):
        run_bounded(HANGS, time.monotonic() + 0.5, threading.Event(), "pip")


def test_a_cancelled_job_stops_the_step() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(JobCancelledError, match="pip stopped"):
        run_bounded(HANGS, time.monotonic() + patient(600), cancel, "pip")


def test_a_failing_step_fails_with_its_error_lines() -> None:
    command = [
        sys.executable,
        "-c",
        "print('Looking in links: x'); print('ERROR: No matching distribution'); exit(1)",
    ]
    with pytest.raises(
        AgentInstallFailedError, match=r"pip failed \(exit 1\): ERROR: No matching distribution$"
    ):
        run_bounded(command, time.monotonic() + patient(600), threading.Event(), "pip")
