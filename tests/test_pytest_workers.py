"""tools/pytest_workers.py: the worker count of ``make pytest``, from the machine's CPUs and memory."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.waiting import patient

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "pytest_workers.py"
GIB = 1024**3


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pytest_workers", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workers_tool = _load()


@pytest.mark.parametrize(
    ("cpus", "memory_gib", "expected"),
    [
        (2, 23, 4),  # two per CPU: the 2-core development machine
        (16, 128, 32),  # at most 32
        (16, 12, 8),  # memory holds fewer than the CPUs would run: 12 / 1.5
        (8, 1, 1),  # never fewer than one
        (1.5, 64, 3),  # a cgroup quota of 1.5 CPUs
    ],
)
def test_two_workers_per_cpu_as_many_as_memory_holds(cpus: float, memory_gib: float, expected: int) -> None:
    assert workers_tool.workers(cpus, int(memory_gib * GIB)) == expected


def test_a_cgroup_quota_limits_the_cpus(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert workers_tool.cgroup_cpus(tmp_path) == 1.5
    assert workers_tool.usable_cpus(tmp_path) == min(1.5, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert workers_tool.cgroup_cpus(tmp_path) is None
    assert workers_tool.usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_is_read_too(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert workers_tool.cgroup_cpus(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert workers_tool.cgroup_cpus(tmp_path) is None


def test_memory_is_what_is_available_and_what_a_cgroup_leaves(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   8388608 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert workers_tool.available_memory(meminfo, cgroup) == 8 * GIB
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{1 * GIB}\n")
    assert workers_tool.available_memory(meminfo, cgroup) == 3 * GIB
    (cgroup / "memory.max").write_text("max\n")
    assert workers_tool.available_memory(meminfo, cgroup) == 8 * GIB


def test_the_script_prints_this_machines_count_and_explains_it() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--explain"],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=True,
    )
    expected = workers_tool.workers(workers_tool.usable_cpus(), workers_tool.available_memory())
    # Memory moves between the two readings; the count is the same unless it crossed a 1.5 GiB step.
    assert abs(int(done.stdout) - expected) <= 1, done.stdout
    assert done.stderr.startswith(f"{done.stdout.strip()} workers: ")
    assert "CPUs x 2" in done.stderr
    assert "GiB available / 1.5 GiB" in done.stderr
