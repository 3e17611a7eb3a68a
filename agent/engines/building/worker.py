"""The build supervisor: runs each build in a child process (:mod:`agent.engines.building.worker_child`).

A TensorRT or ONNX Runtime build can crash (a segfault in a parser or builder), hang, or eat the
device's memory; in a child it cannot take the camera loop down with it. :class:`BuildWorker`
runs one build at a time, kills the child's whole process group when the timeout passes, and turns
every way the child can end into a :class:`~agent.errors.BuildError` that names it:
``builder crashed: SIGSEGV``, ``build timed out after 1800s``, out of memory.

Protocol. The child reads one :class:`~agent.engines.job.BuildJob` as JSON on stdin and writes
JSON lines to its stdout: ``{"type": "progress", "message": ...}``, then one
``{"type": "result", "result": {...}}`` or ``{"type": "error", "code": ..., "message": ...}``.
The child writes its engine and any other files into ``job.out_dir``; the parent caches them.

The memory limit is applied by the child itself before it imports a framework; this side only
chooses it: ``RLIMIT_AS`` (address space) for CPU builds, ``RLIMIT_DATA`` for GPU builds, because
CUDA reserves far more virtual address space than it ever touches and fails under ``RLIMIT_AS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import structlog

from agent.engines.job import BuildJob, Progress, WorkerResult, memory_hint
from agent.errors import BuildError

log = structlog.get_logger(__name__)

#: The child's module, run as ``python -m``.
CHILD_MODULE = "agent.engines.building.worker_child"
#: Seconds between SIGTERM and SIGKILL when a build is stopped.
_KILL_GRACE_S = 2.0
#: Lines of the child's stderr kept for error messages.
_STDERR_TAIL = 40


def signal_name(number: int) -> str:
    """``11`` -> ``'SIGSEGV'``; unknown numbers -> ``'signal 99'``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
        package_root = Path(__file__).resolve().parents[3]
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
            [self.python, "-m", CHILD_MODULE],
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
                message += memory_hint(job.memory_mb)
            log.warning("engine.build.failed", kind=job.kind, error=message)
            raise BuildError(message)
        if rc is not None and rc < 0:
            name = signal_name(-rc)
            # Under a memory limit a failed allocation may end as any of these (a C library that
            # dereferences the NULL it got back segfaults), so the limit is named with each.
            hint = memory_hint(job.memory_mb) if name in ("SIGKILL", "SIGABRT", "SIGSEGV", "SIGBUS") else ""
            if name == "SIGKILL" and not hint:
                hint = " (killed from outside: the kernel's out-of-memory killer?)"
            message = f"builder crashed: {name}{hint}"
        else:
            message = f"builder exited with status {rc} without a result"
            if any(m in tail for m in _OOM_MARKERS):
                message += memory_hint(job.memory_mb) or " (out of memory)"
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
