"""Builds run in a child process: ``python -m agent.engines.worker`` with a JSON job on stdin.

A TensorRT or ONNX Runtime build can crash (a segfault in a parser or builder), hang, or eat the
device's memory; in a child it cannot take the camera loop down with it. The parent
(:class:`BuildWorker`) runs one build at a time, kills the child's whole process group when the
timeout passes, and turns every way the child can end into a :class:`~agent.errors.BuildError`
that names it: ``builder crashed: SIGSEGV``, ``build timed out after 1800s``, out of memory.

Protocol. The child writes JSON lines to its *original* stdout and nothing else: before any
library loads, stdout (fd 1) is pointed at stderr, so whatever TensorRT, ONNX Runtime or Python
print cannot corrupt the protocol. Lines are ``{"type": "progress", "message": ...}``, then one
``{"type": "result", "result": {...}}`` or ``{"type": "error", "code": ..., "message": ...}``.
The child writes its engine and any other files into ``job.out_dir``; the parent caches them.

The memory limit is set by the child itself (``resource.setrlimit``) before it imports a
framework: ``RLIMIT_AS`` (address space) for CPU builds; ``RLIMIT_DATA`` for GPU builds, because
CUDA reserves far more virtual address space than it ever touches and fails under ``RLIMIT_AS``.

Job kinds ``crash``, ``hang`` and ``memory`` exist for tests (a real segfault, a real hang, a real
allocation failure) and run only when the child's environment has ``EDGE_AGENT_BUILD_TEST_JOBS=1``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import Field

from agent.engines.spec import BuildPlan
from agent.errors import BuildError
from agent.model_base import StrictModel

log = structlog.get_logger(__name__)

#: Environment variable that enables the test-only job kinds in the child.
TEST_JOBS_ENV = "EDGE_AGENT_BUILD_TEST_JOBS"

JobKind = Literal["onnxruntime", "tensorrt", "crash", "hang", "memory"]
TEST_KINDS = frozenset({"crash", "hang", "memory"})

#: Seconds between SIGTERM and SIGKILL when a build is stopped.
_KILL_GRACE_S = 2.0
#: Lines of the child's stderr kept for error messages.
_STDERR_TAIL = 40
MIB = 1 << 20

ExtraValue = str | int | float | bool | None
Progress = Callable[[str], None]


class BuildJob(StrictModel):
    """Everything the child needs to build one engine; sent as JSON on its stdin."""

    kind: JobKind
    model: Path = Field(description="The ONNX model to build from.")
    out_dir: Path = Field(description="Where the child writes the engine and its other files.")
    plan: BuildPlan
    engine_file: str = Field("engine", description="File name of the engine inside out_dir.")
    calibration_dir: Path | None = Field(None, description="Calibration batches as .npy files (sorted).")
    calibration_cache: Path | None = Field(
        None, description="TensorRT calibration cache: read if present, written after calibrating."
    )
    timing_cache: Path | None = Field(None, description="TensorRT timing cache of this device.")
    trt_cache_version: str = Field(
        "10.3.0", description="TensorRT version whose header an ONNX Runtime calibration is converted for."
    )
    available_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    memory_mb: int = Field(0, ge=0, description="Memory limit of the child (0 = none).")
    memory_limit: Literal["as", "data"] = "as"


class WorkerResult(StrictModel):
    """What the child built: files in ``out_dir`` plus facts for the sidecar and the job status."""

    engine_file: str
    files: tuple[str, ...] = Field(default=(), description="Other files in out_dir to cache with the engine.")
    extra: dict[str, ExtraValue] = Field(default_factory=dict, description="Scalars for the sidecar.")
    report: dict[str, Any] = Field(default_factory=dict, description="Effective providers, placement, ...")
    build_seconds: float = 0.0


# --------------------------------------------------------------------------- calibration batches


def save_batches(
    batches: Iterable[npt.NDArray[Any]], directory: Path, limit: int | None = None
) -> tuple[int, str]:
    """Write calibration batches as ``batch_NNNNNN.npy`` into ``directory``; returns (count, SHA-256).

    The hash covers each batch's dtype, shape and bytes, so it identifies the calibration data.
    ``limit`` stops after that many batches (an endless stream).
    """
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    count = 0
    for batch in batches:
        if limit is not None and count >= limit:
            break
        array = np.ascontiguousarray(batch)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
        np.save(directory / f"batch_{count:06d}.npy", array, allow_pickle=False)
        count += 1
    return count, digest.hexdigest()


def load_batches(directory: Path) -> Iterator[npt.NDArray[Any]]:
    """The batches :func:`save_batches` wrote, in order."""
    for path in sorted(directory.glob("batch_*.npy")):
        yield np.load(path, allow_pickle=False)


# --------------------------------------------------------------------------- parent side


def signal_name(number: int) -> str:
    """``11`` -> ``'SIGSEGV'``; unknown numbers -> ``'signal 99'``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _memory_hint(memory_mb: int) -> str:
    if memory_mb <= 0:
        return ""
    return f" (the build is limited to {memory_mb} MB: raise engines.build_memory_mb if it needs more)"


_OOM_MARKERS = ("bad_alloc", "MemoryError", "Cannot allocate memory", "Failed to allocate", "out of memory")


class BuildWorker:
    """Runs :class:`BuildJob` s in child processes, one at a time, with a timeout and a memory cap."""

    def __init__(
        self,
        *,
        timeout_s: float,
        memory_mb: int = 0,
        lock_path: Path | None = None,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``lock_path``: a file locked for the duration of each build, so builds by other processes
        on this device (``edge-agent build`` next to the daemon) also run one at a time."""
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.lock_path = lock_path
        self.python = python
        self.env = dict(env or {})
        self.launches = 0
        self._lock = threading.Lock()

    def run(
        self, job: BuildJob, progress: Progress | None = None, cancel: threading.Event | None = None
    ) -> WorkerResult:
        """Build ``job`` in a child process and return its result; BuildError naming any failure.

        ``progress`` receives the child's progress lines (on this thread). Setting ``cancel`` kills
        the child and fails the build. Waits for a running build to finish first (bounded by the
        timeout, since that build is bounded by it too).
        """
        wait_s = self.timeout_s + 4 * _KILL_GRACE_S + 5.0
        if not self._lock.acquire(timeout=wait_s):
            raise BuildError(f"another build is still running after {wait_s:.0f}s; retry later")
        try:
            with self._file_lock(wait_s):
                return self._run_child(job, progress, cancel)
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _file_lock(self, wait_s: float) -> Iterator[None]:
        if self.lock_path is None:
            yield
            return
        import fcntl

        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BuildError(
                            f"another process has been building on this device for {wait_s:.0f}s "
                            f"(lock {self.lock_path}); retry later"
                        ) from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        # The child must import this very agent package. Installed, it is on the default path; run
        # from a source tree, that tree goes on PYTHONPATH (never a site-packages directory: ahead
        # of the standard library it could shadow stdlib modules with backports).
        package_root = Path(__file__).resolve().parents[2]
        if package_root.name not in ("site-packages", "dist-packages"):
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
            )
        env.setdefault("PYTHONFAULTHANDLER", "1")
        return env

    def _run_child(
        self, job: BuildJob, progress: Progress | None, cancel: threading.Event | None
    ) -> WorkerResult:
        if job.memory_mb == 0 and self.memory_mb > 0:
            limit: Literal["as", "data"] = (
                "as" if job.plan.device == "cpu" and job.kind == "onnxruntime" else "data"
            )
            job = job.model_copy(update={"memory_mb": self.memory_mb, "memory_limit": limit})
        job.out_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        proc = subprocess.Popen(
            [self.python, "-m", "agent.engines.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._child_env(),
            start_new_session=True,  # its own process group: a kill takes any grandchildren too
        )
        self.launches += 1
        log.info("engine.build.started", kind=job.kind, pid=proc.pid, model=str(job.model))
        lines: queue.Queue[str | None] = queue.Queue()
        stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        readers = [
            threading.Thread(
                target=_pump,
                args=(proc.stdout, lines.put, lambda: lines.put(None)),
                daemon=True,
                name="build-out",
            ),
            threading.Thread(
                target=_pump, args=(proc.stderr, stderr_tail.append, None), daemon=True, name="build-err"
            ),
        ]
        for reader in readers:
            reader.start()
        try:
            assert proc.stdin is not None
            try:
                proc.stdin.write(job.model_dump_json().encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died at once; its exit status says why
            outcome = self._follow(proc, lines, progress, cancel, started)
        finally:
            _kill_group(proc)
            for reader in readers:
                reader.join(timeout=5.0)
        return self._conclude(job, proc, outcome, stderr_tail, started)

    def _follow(
        self,
        proc: subprocess.Popen[bytes],
        lines: queue.Queue[str | None],
        progress: Progress | None,
        cancel: threading.Event | None,
        started: float,
    ) -> dict[str, Any] | None:
        """Relay progress until the child closes stdout; the final result/error message, if any."""
        deadline = started + self.timeout_s
        final: dict[str, Any] | None = None
        while True:
            if cancel is not None and cancel.is_set():
                _kill_group(proc)
                log.warning("engine.build.cancelled", pid=proc.pid)
                raise BuildError("build cancelled: the agent is stopping or the job was superseded")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill_group(proc)
                log.warning("engine.build.timed_out", pid=proc.pid, timeout_s=self.timeout_s)
                raise BuildError(
                    f"build timed out after {self.timeout_s:g}s and was killed; raise "
                    "engines.build_timeout_s or build a smaller model or a lower optimization level"
                )
            try:
                line = lines.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if line is None:  # stdout closed: the child is exiting
                break
            message = _parse_line(line)
            if message is None:
                continue
            if message.get("type") == "progress":
                _relay(progress, str(message.get("message", "")))
            elif message.get("type") in ("result", "error"):
                final = message
        try:
            proc.wait(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait(timeout=10.0)
        return final

    def _conclude(
        self,
        job: BuildJob,
        proc: subprocess.Popen[bytes],
        final: dict[str, Any] | None,
        stderr_tail: deque[str],
        started: float,
    ) -> WorkerResult:
        rc = proc.returncode
        tail = "\n".join(list(stderr_tail)[-15:])
        seconds = time.monotonic() - started
        if final is not None and final.get("type") == "result" and rc == 0:
            result = WorkerResult.model_validate(final.get("result"))
            log.info("engine.build.finished", kind=job.kind, seconds=round(seconds, 3))
            return result.model_copy(update={"build_seconds": seconds})
        if final is not None and final.get("type") == "error":
            message = str(final.get("message", "build failed"))
            if final.get("code") == "out_of_memory" or any(m in message for m in _OOM_MARKERS):
                message += _memory_hint(job.memory_mb)
            log.warning("engine.build.failed", kind=job.kind, error=message)
            raise BuildError(message)
        if rc is not None and rc < 0:
            name = signal_name(-rc)
            # Under a memory limit a failed allocation may end as any of these (a C library that
            # dereferences the NULL it got back segfaults), so the limit is named with each.
            hint = _memory_hint(job.memory_mb) if name in ("SIGKILL", "SIGABRT", "SIGSEGV", "SIGBUS") else ""
            if name == "SIGKILL" and not hint:
                hint = " (killed from outside: the kernel's out-of-memory killer?)"
            message = f"builder crashed: {name}{hint}"
        else:
            message = f"builder exited with status {rc} without a result"
            if any(m in tail for m in _OOM_MARKERS):
                message += _memory_hint(job.memory_mb) or " (out of memory)"
        if tail:
            message += f"; last output:\n{tail}"
        log.warning("engine.build.failed", kind=job.kind, returncode=rc, error=message.splitlines()[0])
        raise BuildError(message)


def _pump(stream: IO[bytes] | None, sink: Callable[[str], None], on_end: Callable[[], None] | None) -> None:
    """Read ``stream`` line by line into ``sink``; call ``on_end`` when it closes."""
    try:
        if stream is not None:
            for raw in iter(stream.readline, b""):
                sink(raw.decode("utf-8", "replace").rstrip("\n"))
    except (OSError, ValueError):
        pass
    finally:
        if on_end is not None:
            on_end()


def _parse_line(line: str) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except ValueError:
        log.warning("engine.build.protocol", line=line[:200])
        return None
    return message if isinstance(message, dict) else None


def _relay(progress: Progress | None, message: str) -> None:
    log.info("engine.build.progress", message=message)
    if progress is None:
        return
    try:
        progress(message)
    except Exception as exc:  # noqa: BLE001 - a broken observer must not fail the build
        log.warning("engine.build.progress_callback_failed", error=str(exc))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's process group, SIGKILL after a grace period; no-op once it is gone."""
    if proc.poll() is not None:
        return  # exited and reaped: its process group id may already name someone else's group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10.0)


# --------------------------------------------------------------------------- child side


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
    """Test-only jobs: a real segfault, a real hang, a real allocation failure."""
    if os.environ.get(TEST_JOBS_ENV) != "1":
        raise BuildError(f"job kind {job.kind!r} is for tests only ({TEST_JOBS_ENV}=1)")
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


def _run_tensorrt(job: BuildJob, say: Progress) -> WorkerResult:
    """TensorRT build in the child: optional Q/DQ quantization (TensorRT 11), then build_engine."""
    from agent.engines.trt_builder import build_engine

    model = job.model
    calib_batches: Iterable[Any] | None = None
    if job.plan.int8_mode == "qdq" and job.calibration_dir is not None:
        # TensorRT >= 11 has no calibrators: quantize to Q/DQ with ONNX Runtime's calibrator first.
        from agent.engines.int8 import quantize_int8

        say("quantizing to Q/DQ for TensorRT")
        batches = load_batches(job.calibration_dir)
        model = quantize_int8(model, job.out_dir / "qdq", batches, target="tensorrt").model_path
    elif job.plan.int8_mode == "calibrator":
        if job.calibration_cache is not None and job.calibration_cache.is_file():
            import tensorrt as trt

            from agent.engines.calibration_cache import check_cache_version, read_trt_cache
            from agent.engines.trt_calibrator import read_cache_bytes

            data = read_cache_bytes(job.calibration_cache)
            if data is not None:
                check_cache_version(read_trt_cache(data), trt.__version__)
        if job.calibration_dir is not None:
            calib_batches = load_batches(job.calibration_dir)
    built = build_engine(
        model,
        job.plan,
        timing_cache=job.timing_cache,
        calibration_cache=job.calibration_cache,
        calib_batches=calib_batches,
        log=say,
    )
    (job.out_dir / job.engine_file).write_bytes(built.plan)
    placement = built.placement
    return WorkerResult(
        engine_file=job.engine_file,
        extra={
            "trt_version": built.trt_version,
            "dla_layers": placement.dla_layers,
            "gpu_layers": placement.gpu_layers,
            "placement_source": placement.source,
        },
        report={"placement": placement.as_dict(), "warnings": built.warnings[-20:]},
        build_seconds=built.build_seconds,
    )


def run_job(job: BuildJob, say: Progress) -> WorkerResult:
    """Execute ``job`` in this process (the child). Raises BuildError on failure."""
    if job.kind in TEST_KINDS:
        return _run_test_job(job, say)
    if job.kind == "tensorrt":
        return _run_tensorrt(job, say)
    from agent.engines.ort_builder import build_onnxruntime

    return build_onnxruntime(job, say)


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
        emit({"type": "error", "code": "build_failed", "message": message + _memory_hint(job.memory_mb)})
        return 1
    emit({"type": "result", "result": result.model_dump(mode="json")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
