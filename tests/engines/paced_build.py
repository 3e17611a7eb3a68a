"""A real build held back until the test lets it go: serve-while-building's slow build.

The build child (:mod:`agent.engines.building.worker_child`) runs :func:`pace_build` before a real ONNX
Runtime build when ``EDGE_AGENT_BUILD_TEST_JOBS`` names this module. It reports calibration frames
as a slow INT8 build would, and waits until the file :data:`GATE_ENV` names exists: the test, not a
clock, decides how long the build takes (minutes on a Jetson; here, until the test has seen what
it must see while the build runs). The build that follows is real.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from agent.engines.building.worker_child import TEST_JOBS_ENV
from agent.engines.job import BuildJob, Progress, WorkerResult
from agent.errors import BuildError

#: Environment variable naming the file whose creation releases the build.
GATE_ENV = "EDGE_AGENT_TEST_BUILD_GATE"
#: Frames the stand-in's "calibration" reports while it waits.
FRAMES = 500


def env(gate: Path) -> dict[str, str]:
    """The daemon's environment additions: its build child paces real builds on ``gate``."""
    return {TEST_JOBS_ENV: __name__, GATE_ENV: str(gate)}


def pace_build(job: BuildJob, say: Progress) -> None:
    """Report two calibration lines, then say nothing until the gate file exists: a step that is
    silent for minutes, as a TensorRT compile is (the device's heartbeat must move elapsed)."""
    gate = Path(os.environ[GATE_ENV])
    say(f"calibrating 0/{FRAMES} frames")
    say(f"calibrating 1/{FRAMES} frames")
    while not gate.exists():
        time.sleep(0.05)  # the poll of a file the test creates; the test itself waits on events
    say(f"calibrating {FRAMES}/{FRAMES} frames")


def run_test_job(job: BuildJob, say: Progress) -> WorkerResult:
    raise BuildError(f"{__name__} only paces real builds; job kind {job.kind!r} is not one")
