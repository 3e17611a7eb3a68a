"""The build child: ``python -m agent.engines.building.worker_child`` with a JSON job on stdin.

Started by :class:`~agent.engines.building.worker.BuildWorker`, it runs one build and answers on its
*original* stdout, and nothing else writes there: before any library loads, stdout (fd 1) is
pointed at stderr, so whatever TensorRT, ONNX Runtime or Python print cannot corrupt the protocol.

The memory limit is set here (``resource.setrlimit``) before a framework is imported, so the import
itself is bounded too.

Test jobs. Tests need a real segfault, a real hang and a real allocation failure in a real child.
Those jobs live in the tests, not here: when ``EDGE_AGENT_BUILD_TEST_JOBS`` names a module, a job
of a kind other than ``onnxruntime``/``tensorrt`` runs that module's ``run_test_job(job, say)``.
Without the variable such a job is refused, so production never imports test code. The same module
may pace a real build (its ``pace_build(job, say)`` runs first): a build as slow as a test needs.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from agent.engines.job import BUILD_KINDS, MIB, BuildJob, Progress, WorkerResult, memory_hint
from agent.errors import BuildError

#: Environment variable naming the module of the test-only job kinds (set only by tests).
TEST_JOBS_ENV = "EDGE_AGENT_BUILD_TEST_JOBS"


def raised_during_import(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a module was being imported (a frame of importlib's bootstrap)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        tb = tb.tb_next
    return False


def _apply_memory_limit(job: BuildJob) -> None:
    if job.memory_mb <= 0:
        return
    import resource

    limit = job.memory_mb * MIB
    which = resource.RLIMIT_AS if job.memory_limit == "as" else resource.RLIMIT_DATA
    resource.setrlimit(which, (limit, limit))


def _run_test_job(job: BuildJob, say: Progress) -> WorkerResult:
    """A test-only job, from the module ``EDGE_AGENT_BUILD_TEST_JOBS`` names; refused without it."""
    module_name = os.environ.get(TEST_JOBS_ENV)
    if not module_name:
        raise BuildError(
            f"job kind {job.kind!r} is for tests only ({TEST_JOBS_ENV} names their module); "
            f"builds are {', '.join(sorted(BUILD_KINDS))}"
        )
    run: Any = importlib.import_module(module_name).run_test_job
    result = run(job, say)
    if not isinstance(result, WorkerResult):
        raise BuildError(f"test job {job.kind!r} of {module_name} returned {type(result).__name__}")
    return result


def _pace_real_build(job: BuildJob, say: Progress) -> None:
    """A real build held back by the tests' module (its ``pace_build(job, say)``), when it has one.

    Serve-while-building is tested on a real build that takes as long as the test wants: the module
    ``EDGE_AGENT_BUILD_TEST_JOBS`` names decides when the build proceeds. Without the variable
    (production) nothing is imported and nothing waits."""
    module_name = os.environ.get(TEST_JOBS_ENV)
    if not module_name:
        return
    pace: Any = getattr(importlib.import_module(module_name), "pace_build", None)
    if pace is not None:
        pace(job, say)


def run_job(job: BuildJob, say: Progress) -> WorkerResult:
    """Execute ``job`` in this process (the child). Raises BuildError on failure."""
    if job.kind in BUILD_KINDS:
        _pace_real_build(job, say)
    if job.kind in BUILD_KINDS and job.plan.slim and job.slim_cache_dir is not None:
        from agent.engines.building.slim import onnxslim_version, slim_model

        if onnxslim_version() is None:
            # A declared dependency, but an install with --no-deps (or a hand-made venv on a Jetson)
            # may lack it: build from the model as given and say so, rather than fail every build.
            skipped = "onnxslim is not installed: built from the model as given (pip install onnxslim)"
            say(skipped)
            result = _build(job, say)
            return result.model_copy(update={"report": {**result.report, "slim": {"skipped": skipped}}})
        slimmed = slim_model(job.model, job.model_sha256 or "unhashed", job.slim_cache_dir)
        say(
            f"onnxslim {slimmed.onnxslim_version}: {slimmed.nodes_before} -> {slimmed.nodes_after} nodes"
            + (" (cached)" if slimmed.cached else "")
        )
        result = _build(job.model_copy(update={"model": slimmed.path}), say)
        return result.model_copy(update={"report": {**result.report, "slim": slimmed.report()}})
    return _build(job, say)


def _build(job: BuildJob, say: Progress) -> WorkerResult:
    if job.kind == "tensorrt":
        from agent.engines.trt.builder import build_tensorrt

        return build_tensorrt(job, say)
    if job.kind == "onnxruntime":
        from agent.engines.building.ort import build_onnxruntime

        return build_onnxruntime(job, say)
    return _run_test_job(job, say)


def main() -> int:
    """Child entry point: read the job from stdin, build, answer on the protocol stream."""
    # Keep the real stdout for the protocol and send fd 1 to stderr, so nothing a library prints
    # (TensorRT, ONNX Runtime, Python) can interleave with the JSON lines.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import faulthandler

    faulthandler.enable(file=sys.stderr)

    def emit(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message, default=str) + "\n")
        proto.flush()

    def say(text: str) -> None:
        emit({"type": "progress", "message": text})

    try:
        job = BuildJob.model_validate_json(sys.stdin.buffer.read())
    except ValueError as exc:
        emit({"type": "error", "code": "bad_job", "message": f"build job is invalid: {exc}"})
        return 2
    try:
        _apply_memory_limit(job)
        result = run_job(job, say)
    except MemoryError:
        emit({"type": "error", "code": "out_of_memory", "message": "the build ran out of memory"})
        return 1
    except BuildError as exc:
        emit({"type": "error", "code": "build_failed", "message": str(exc)})
        return 1
    except Exception as exc:  # noqa: BLE001 - the child reports every failure to the parent
        message = f"{type(exc).__name__}: {exc}"
        if job.memory_mb > 0 and raised_during_import(exc):
            # Under an address-space limit a failed allocation inside the import machinery does not
            # always surface as MemoryError (seen: "ValueError: field 'target' is required for
            # AnnAssign" from the compiler). A framework import that fails under a limit is reported
            # as what it almost surely is, with the original error kept.
            message = f"importing the build framework failed under the memory limit ({message})"
            emit({"type": "error", "code": "out_of_memory", "message": message})
            return 1
        # The same odd errors also come from code the compiler runs outside an import (dataclasses
        # and pydantic exec generated source): under a limit, name it beside the error.
        emit({"type": "error", "code": "build_failed", "message": message + memory_hint(job.memory_mb)})
        return 1
    emit({"type": "result", "result": result.model_dump(mode="json")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
