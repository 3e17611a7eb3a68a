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
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "created: 3/3 workers" in output, output[-3000:]
    assert "17 passed" in output, output[-3000:]
