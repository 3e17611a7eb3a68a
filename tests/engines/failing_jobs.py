"""Build jobs that fail for real, for the worker's tests: a segfault, a hang, an allocation failure.

The build child (:mod:`agent.engines.building.worker_child`) runs these only when
``EDGE_AGENT_BUILD_TEST_JOBS`` names this module, which :data:`TEST_ENV` does for a
:class:`~agent.engines.building.worker.BuildWorker`.
They are here, not in the agent package, because nothing but the tests ever runs them.
"""

from __future__ import annotations

import time

from agent.engines.building.worker_child import TEST_JOBS_ENV
from agent.engines.job import MIB, BuildJob, Progress, WorkerResult
from agent.errors import BuildError

#: Environment for a BuildWorker whose child may run the jobs below.
TEST_ENV = {TEST_JOBS_ENV: __name__}


def run_test_job(job: BuildJob, say: Progress) -> WorkerResult:
    """Fail the way ``job.kind`` says: ``crash`` (SIGSEGV), ``hang`` (forever), ``memory`` (MemoryError)."""
    if job.kind == "crash":
        say("about to crash")
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    elif job.kind == "hang":
        say("hanging")
        while True:
            time.sleep(1.0)
    elif job.kind == "memory":
        say("allocating")
        hog = bytearray(4 * job.memory_mb * MIB if job.memory_mb else 1 << 40)
        del hog
    raise BuildError(f"test job {job.kind!r} did not fail")
