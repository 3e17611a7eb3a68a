"""How many CPUs this process may use: its affinity, lowered to its container's CPU quota.

Sizes the inference layout and ONNX Runtime's threads (``docker --cpus 2`` sets a quota, not a
cpuset, so the affinity alone would say every core of the host).
"""

from __future__ import annotations

import os
from pathlib import Path

#: cgroup v2 CPU limit of this process's cgroup (``max 100000`` when unlimited).
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cpu_quota(cpu_max: str | None) -> int | None:
    """Whole CPUs a cgroup v2 ``cpu.max`` (``"<quota> <period>"``) allows, rounded up; None if unlimited."""
    if not cpu_max:
        return None
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, -(-quota // period))


def usable_cpus(cpu_max_file: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity (a container's cpuset, taskset), lowered to the
    container's CPU quota (``docker --cpus 2`` sets a quota, not a cpuset)."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # sched_getaffinity is Linux-only
        cpus = os.cpu_count() or 1
    quota = cpu_quota(_read(cpu_max_file))
    return min(cpus, quota) if quota is not None else cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None
