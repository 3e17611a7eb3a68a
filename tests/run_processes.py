"""Every process a test run starts ends with the run, however the run ends (docs/testing.md).

Each pytest process of a run (the one started by hand or by ``make``, and each pytest-xdist worker)
records every child it starts (``subprocess.Popen``: mosquitto, agent daemons, controllers,
Prometheus, nginx, Playwright's driver and through it Chromium, the workers themselves) as a file
in the run's registry folder, named by its pid and its start time (a pid alone may be reused), and
every second the descendants of those (a daemon's build worker or camera pipeline in a session of
its own outlives its parent's process group, and once orphaned no longer shows whose it was):

    $TMPDIR/edge-agent-test-runs-UID/RUN/OWNER/CHILD     RUN, OWNER, CHILD: "pid-starttime"

When a pytest process ends (its session over, a failure, Ctrl-C's KeyboardInterrupt, SIGTERM or
SIGHUP) it ends what it recorded and is still running, with every descendant of those (SIGTERM,
then SIGKILL after a grace). The process that started the run then ends what any of its workers
recorded, for a worker killed before it could. A run that could do neither (SIGKILL, a power
cut) leaves its records: the next run to start ends what they name and is still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from tests.waiting import patient

#: The registry's folder (default: one per user in the temporary folder), for a test of this module.
ROOT_ENV = "EDGE_AGENT_TEST_RUNS_DIR"
#: The run's id, set by the process that starts the run for its workers to find.
RUN_ENV = "EDGE_AGENT_TEST_RUN"
#: How long a process told to stop (SIGTERM) has before it is killed, before the patience.
GRACE_S = 2.0
#: How often the descendants of the recorded processes are recorded too.
SCAN_EVERY_S = 1.0


@dataclass(frozen=True)
class Proc:
    """A process by pid and start time (clock ticks since boot), which no reuse of the pid shares."""

    pid: int
    start: int

    @property
    def name(self) -> str:
        return f"{self.pid}-{self.start}"

    @classmethod
    def parse(cls, name: str) -> Proc | None:
        pid, _, start = name.partition("-")
        return cls(int(pid), int(start)) if pid.isdigit() and start.isdigit() else None

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        """The running process ``pid`` (None once it ended, a zombie included)."""
        stat = _stat(pid)
        return cls(pid, stat[1]) if stat is not None else None

    def running(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a running process, from /proc/PID/stat; None if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": the comm may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def registry_root() -> Path:
    return Path(
        os.environ.get(ROOT_ENV) or Path(tempfile.gettempdir()) / f"edge-agent-test-runs-{os.getuid()}"
    )


def _children(pid: int) -> list[Proc] | None:
    """The running children of ``pid`` from its threads' ``children`` files; None where the kernel
    has none (built without CONFIG_PROC_CHILDREN)."""
    found: list[Proc] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            listed = (task / "children").read_text().split()
        except FileNotFoundError:
            if not (task / "stat").exists():
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
        found += [proc for proc in map(Proc.of, map(int, listed)) if proc is not None]
    return found


def _all_children() -> dict[int, list[Proc]]:
    """Every running process by its parent, from a scan of /proc."""
    children: dict[int, list[Proc]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(Proc(int(entry.name), stat[1]))
    return children


def _with_descendants(procs: Iterable[Proc]) -> list[Proc]:
    """``procs`` that still run and every running descendant of theirs."""
    scanned: dict[int, list[Proc]] | None = None
    found: list[Proc] = []
    todo = [p for p in procs if p.running()]
    while todo:
        proc = todo.pop()
        if proc in found:
            continue
        found.append(proc)
        children = _children(proc.pid) if scanned is None else None
        if children is None:
            scanned = scanned if scanned is not None else _all_children()
            children = scanned.get(proc.pid, [])
        todo += children
    return found


def end(procs: Iterable[Proc]) -> list[Proc]:
    """SIGTERM to each of ``procs`` still running and its descendants, SIGKILL to those left after
    the grace; returns those it had to signal."""
    targets = _with_descendants(procs)
    for proc in targets:
        with contextlib.suppress(ProcessLookupError):
            if proc.running():
                os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + patient(GRACE_S)
    while any(p.running() for p in targets) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in targets:
        with contextlib.suppress(ProcessLookupError):
            if proc.running():
                os.kill(proc.pid, signal.SIGKILL)
    return targets


def _recorded(folder: Path) -> list[Proc]:
    found = (Proc.parse(f.name) for f in folder.rglob("*") if f.is_file())
    return [p for p in found if p is not None]


class RunProcesses:
    """This pytest process's part of the registry: what it records and what it ends."""

    def __init__(self, root: Path, run: str, me: Proc, *, starts_run: bool) -> None:
        self.root, self.run_dir = root, root / run
        self.mine = self.run_dir / me.name
        self.starts_run = starts_run
        self._lock = threading.Lock()
        self._ended = False
        self._live: set[Proc] = set()
        self._stopped = threading.Event()
        self.mine.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._scan, name="run-processes", daemon=True).start()

    def record(self, pid: int) -> None:
        proc = Proc.of(pid)
        if proc is not None:
            self._add(proc)

    def _add(self, proc: Proc) -> None:
        with self._lock:
            self._live.add(proc)
        with contextlib.suppress(OSError):
            (self.mine / proc.name).touch()

    def _scan(self) -> None:
        while not self._stopped.wait(SCAN_EVERY_S):
            with self._lock:
                live = {p for p in self._live if p.running()}
                self._live = live
                known = frozenset(live)  # _add changes the live set from other threads meanwhile
            if known:
                for proc in _with_descendants(known):
                    if proc not in known:
                        self._add(proc)

    def end(self) -> None:
        """End what this process recorded; the run's starter then ends what its workers recorded."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._stopped.set()
        end(_recorded(self.mine))
        if self.starts_run:
            end(_recorded(self.run_dir))
            shutil.rmtree(self.run_dir, ignore_errors=True)


def sweep(root: Path) -> list[Proc]:
    """End what the runs whose starter is gone recorded and still runs; forget those runs."""
    ended: list[Proc] = []
    if not root.is_dir():
        return ended
    for run_dir in root.iterdir():
        starter = Proc.parse(run_dir.name)
        if starter is not None and starter.running():
            continue
        ended += end(_recorded(run_dir))
        shutil.rmtree(run_dir, ignore_errors=True)
    return ended


#: This process's registry once :func:`start` ran (a list: set once, read by the Popen hook).
_current: list[RunProcesses] = []
_popen_init = subprocess.Popen.__init__


def _recording_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
    _popen_init(self, *args, **kwargs)
    for registry in _current:
        registry.record(self.pid)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM or SIGHUP: end the run's processes, then end as the signal would have."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C now would cut the ending short
    stop()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def start() -> RunProcesses:
    """Record this process's children from now on; called once per pytest process at configure.

    A pytest-xdist worker joins its starter's run (``RUN_ENV``); any other pytest process starts a
    run of its own, after ending what dead runs left behind.
    """
    me = Proc.of(os.getpid())
    assert me is not None
    root = registry_root()
    worker = "PYTEST_XDIST_WORKER" in os.environ and RUN_ENV in os.environ
    if not worker:
        sweep(root)
        os.environ[RUN_ENV] = me.name  # inherited by the workers it starts
    registry = RunProcesses(root, os.environ[RUN_ENV], me, starts_run=not worker)
    _current[:] = [registry]
    subprocess.Popen.__init__ = _recording_init  # type: ignore[method-assign]
    atexit.register(stop)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_signal)
    return registry


def stop() -> None:
    """End this process's recorded children (and, for the run's starter, the run's)."""
    for registry in _current:
        registry.end()
