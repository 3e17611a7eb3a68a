"""Waiting for something that happens in another thread or process, with a bound."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Every bound of the shared waiting helpers (this module, ``tests.mqtt_probe.Probe``, the camera
#: ``Recorder``, the e2e ``Daemon``) is multiplied by this. A bound only says when to give up on an
#: event that has not come: a passing test returns as soon as its event comes and never pays it, and
#: a machine with a load average in the hundreds takes several times the quiet machine's time for
#: the same event (docs/testing.md). ``EDGE_AGENT_TEST_PATIENCE=1`` gives the bounds as written.
PATIENCE = float(os.environ.get("EDGE_AGENT_TEST_PATIENCE", "4"))


def patient(timeout: float) -> float:
    """``timeout`` as this machine's patience stretches it."""
    return timeout * PATIENCE


def patient_ms(seconds: float) -> float:
    """:func:`patient` in milliseconds, for Playwright's ``timeout=``."""
    return patient(seconds) * 1000


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds (times :data:`PATIENCE`)."""
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {patient(timeout)}s waiting for {what}")
