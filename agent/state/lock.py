"""One agent per state directory: ``<state_dir>/agent.lock``, locked (flock) for the process lifetime.

Two agents on one state directory (a config copied with only ``device_id`` changed) would share the
spool, state.json, jobs.json and the model store, each overwriting what the other wrote. The second
one exits instead, naming the first one's pid. A kernel lock, not a pid file: it goes when its
process ends, however it ends (SIGKILL, power cut), so a stale file never keeps an agent from starting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

import structlog

from agent.errors import AgentError

log = structlog.get_logger(__name__)

#: The lock file inside the state directory; it holds the pid of the agent that holds the lock.
LOCK_FILE_NAME = "agent.lock"
#: Errors that mean the lock file cannot be created for want of space: the agent starts unlocked.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class StateDirBusyError(AgentError):
    """Another agent process holds the state directory."""

    code = "state_dir_busy"


class StateDirLock:
    """The held lock of one state directory; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateDirLock:
        """Lock ``state_dir`` (created if missing) for this process; StateDirBusyError if another holds it.

        A full disk that cannot even create the empty lock file does not stop the agent: it runs
        unlocked and says so (a device that will not start cannot be fixed remotely).
        """
        path = Path(state_dir) / LOCK_FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            log.warning("agent.state_dir.unlocked", path=str(path), error=str(exc))
            return cls(path, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateDirBusyError(
                f"state directory {path.parent} is in use by another edge-agent (pid {holder}); stop "
                "that one, or give this one a state_dir of its own"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The pid is for the message above only: a full disk that refuses it changes nothing.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let the lock go (idempotent). The file stays: removing it would race the next agent's lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def holder_pid(state_dir: Path) -> int | None:
    """The pid of the agent that holds ``state_dir`` now, None when no process holds it."""
    path = Path(state_dir) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            return int(holder) if holder.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """The pid the holder wrote, or ``unknown`` (it may not have written it yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
