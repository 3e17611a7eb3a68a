"""CPUs this process may use: the affinity lowered to a cgroup v2 quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.machine.cpus import cpu_quota, usable_cpus


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", None),  # no limit
        ("200000 100000\n", 2),  # docker --cpus 2
        ("150000 100000", 2),  # 1.5 CPUs: two threads can each get work done
        ("50000 100000", 1),
        ("", None),
        (None, None),
        ("garbage", None),
        ("0 100000", None),
    ],
)
def test_cgroup_cpu_quota(cpu_max: str | None, expected: int | None) -> None:
    assert cpu_quota(cpu_max) == expected


def test_usable_cpus_is_the_affinity_lowered_to_the_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    limited = tmp_path / "cpu.max"
    limited.write_text("100000 100000\n")
    unlimited = tmp_path / "cpu.max.unlimited"
    unlimited.write_text("max 100000\n")
    assert usable_cpus(limited) == 1
    assert usable_cpus(unlimited) == affinity
    assert usable_cpus(tmp_path / "absent") == affinity  # cgroup v1 or no cgroup fs: affinity only
