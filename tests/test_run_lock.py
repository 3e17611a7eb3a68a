"""The run lock of tests/conftest.py: under pytest-xdist an ``alone`` test has the run to itself.

A real inner pytest run on 3 workers, with this repository's conftest.py, over tests that mark
themselves running in a folder while they work: the ``alone`` test must never see another one
there, nor any other test see it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import patient

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed (make test installs it)"
)

INNER = '''
import os
import time
from pathlib import Path

import pytest

RUNNING = Path(os.environ["RUN_LOCK_RUNNING"])


def work(name: str) -> list[str]:
    """Say we run, work a while (the time another worker needs to start a test beside us), stop."""
    (RUNNING / name).touch()
    try:
        seen = set()
        for _ in range(10):
            seen.update(p.name for p in RUNNING.iterdir())
            time.sleep(0.03)
        return sorted(seen - {name})
    finally:
        (RUNNING / name).unlink()


@pytest.mark.parametrize("i", range(8))
def test_before(i):
    assert "alone" not in work(f"before-{i}")


@pytest.mark.alone
def test_alone():
    assert work("alone") == []


@pytest.mark.parametrize("i", range(8))
def test_after(i):
    assert "alone" not in work(f"after-{i}")
'''


@pytest.mark.slow  # an inner run of its own: started first under xdist (tests/conftest.py)
def test_an_alone_test_runs_with_no_other_test_of_the_run_beside_it(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", project / "tests" / "conftest.py")
    (project / "tests" / "test_inner.py").write_text(textwrap.dedent(INNER))
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs alone\n")
    running = tmp_path / "running"
    running.mkdir()
    # Not this run's worker: the inner run has its own (xdist tells its workers by these variables).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["RUN_LOCK_RUNNING"] = str(running)
    # The tests after the alone one stay after it (not moved before it, as alone tests go last): what
    # arrives while it runs is what the turnstile must hold back.
    env["EDGE_AGENT_TEST_ORDER"] = "files"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "3",
            "--basetemp",
            str(tmp_path / "t"),
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(300),
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "created: 3/3 workers" in output, output[-3000:]
    assert "17 passed" in output, output[-3000:]


class _Stub:
    """A collected test as the ordering hook reads it: a name and its markers."""

    def __init__(self, name: str, *markers: str) -> None:
        self.name, self.markers = name, markers

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


@pytest.mark.parametrize(
    ("worker", "order", "expected"),
    [
        ("gw0", None, ["slow-1", "slow-2", "a", "b", "alone"]),
        (None, None, ["a", "slow-1", "alone", "b", "slow-2"]),  # serial: the files' order
        ("gw0", "files", ["a", "slow-1", "alone", "b", "slow-2"]),
    ],
    ids=["xdist", "serial", "files"],
)
def test_under_xdist_slow_tests_go_first_and_alone_tests_last(
    monkeypatch: pytest.MonkeyPatch, worker: str | None, order: str | None, expected: list[str]
) -> None:
    from tests.conftest import pytest_collection_modifyitems

    for name, value in (("PYTEST_XDIST_WORKER", worker), ("EDGE_AGENT_TEST_ORDER", order)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    items = [
        _Stub("a"),
        _Stub("slow-1", "slow"),
        _Stub("alone", "alone", "slow"),  # alone wins: it waits for whatever runs beside it
        _Stub("b"),
        _Stub("slow-2", "slow"),
    ]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.name for item in items] == expected
