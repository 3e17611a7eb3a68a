"""How many pytest-xdist workers ``make pytest`` runs on this machine: printed for the Makefile.

Two workers per CPU the run may use, and no more than the memory available holds at
:data:`GIB_PER_WORKER` each (docs/testing.md, "How many workers"):

    python3 tools/pytest_workers.py            # prints the count, e.g. 4 on 2 cores and 23 GiB
    python3 tools/pytest_workers.py --explain  # and why

Most tests wait on real processes rather than compute, so a worker keeps about a third of a core
busy and two per core keep the cores busy; more only queue on them, and every wait then stretches.
A worker may hold a pytest process, three agent daemons, a controller and Chromium at once.
Standard library only: the Makefile runs it before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: Workers per usable CPU.
WORKERS_PER_CPU = 2
#: Memory one worker may use at its peak, in GiB (its pytest, up to three agent daemons of
#: numpy, OpenCV and ONNX Runtime, a controller, Chromium).
GIB_PER_WORKER = 1.5
GIB = 1024**3
#: The most workers the count gives: beyond it the run's start-up and its few long tests dominate.
MAX_WORKERS = 32


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs a cgroup quota allows (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> float:
    """The CPUs this process may run on (its affinity), fewer where a cgroup quota says so."""
    cpus: float = len(os.sched_getaffinity(0))
    quota = cgroup_cpus(root)
    return min(cpus, quota) if quota is not None else cpus


def available_memory(meminfo: Path = Path("/proc/meminfo"), root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes available now: ``MemAvailable``, less where a cgroup limit leaves less."""
    available = 0
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            used = int((root / "memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def workers(cpus: float, memory: int) -> int:
    """The worker count for ``cpus`` usable CPUs and ``memory`` bytes available: at least 1."""
    by_cpu = int(cpus * WORKERS_PER_CPU)
    by_memory = int(memory / (GIB_PER_WORKER * GIB))
    return max(1, min(by_cpu, by_memory, MAX_WORKERS))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="say what the count came from (on stderr)")
    args = parser.parse_args(argv)
    cpus, memory = usable_cpus(), available_memory()
    count = workers(cpus, memory)
    if args.explain:
        by_cpu, by_memory = int(cpus * WORKERS_PER_CPU), int(memory / (GIB_PER_WORKER * GIB))
        print(
            f"{count} workers: {cpus:g} CPUs x {WORKERS_PER_CPU} = {by_cpu}, "
            f"{memory / GIB:.1f} GiB available / {GIB_PER_WORKER:g} GiB = {by_memory}, at most {MAX_WORKERS}",
            file=sys.stderr,
        )
    print(count)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
