"""tests/run_processes.py: what a test run starts ends with it, Ctrl-C and SIGTERM included.

Real runs: an inner ``pytest`` (this repository's conftest.py) over a test that starts a real
mosquitto, a real agent daemon and a child whose own child sits in a session of its own, then
hangs. The outer test interrupts that run as an operator would (SIGINT to pytest, SIGTERM, Ctrl-C
at a terminal running ``make``, which signals make's whole process group) and checks that none of
those processes survives it. The registry folder is the test's own, so the inner runs' records
are theirs alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.run_processes import ROOT_ENV, Proc, end, sweep
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

INNER = '''
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.daemon import AgentFiles, Daemon
from tests.waiting import wait_until

OUT = Path(os.environ["RUN_PROCESSES_OUT"])
#: A child that starts a grandchild in a session of its own (as the agent's build worker and
#: GStreamer camera do), so that no process group holds both.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(3600)
"""


def test_hangs_with_processes_running(broker, tmp_path):
    files = AgentFiles(tmp_path / "agent", broker.port, "leftovers-" + str(os.getpid()), frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    daemon = Daemon(files.write_config(stream=stream), tmp_path / "agent.log")
    daemon.wait_for_event("agent.started", timeout=60)
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    pids = {"mosquitto": broker.pid, "daemon": daemon.proc.pid, "child": parent.pid, "grandchild": grandchild}
    (OUT / "pids.json.tmp").write_text(json.dumps(pids))
    (OUT / "pids.json.tmp").rename(OUT / "pids.json")
    time.sleep(3600)  # interrupted here by the outer test
'''

MAKEFILE = """
pytest:
\t{python} -m pytest -q -p no:cacheprovider $(ARGS) tests
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", project / "tests" / "conftest.py")
    (project / "tests" / "test_inner.py").write_text(INNER)
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    alone: alone\n")
    (project / "Makefile").write_text(MAKEFILE.format(python=sys.executable))
    (project / "out").mkdir()
    return project


def _env(project: Path) -> dict[str, str]:
    # Not this run's worker: the inner run is one of its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.pop("EDGE_AGENT_TEST_RUN", None)
    env.pop("MAKEFLAGS", None)
    env.pop("MAKELEVEL", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["RUN_PROCESSES_OUT"] = str(project / "out")
    env[ROOT_ENV] = str(project / "registry")
    return env


@pytest.fixture
def started(project: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The inner runs a test starts; killed at teardown, whatever the test saw."""
    runs: list[subprocess.Popen[bytes]] = []
    yield runs
    for run in runs:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(patient(10))


def _start(project: Path, runs: list[subprocess.Popen[bytes]], command: list[str]) -> dict[str, Proc]:
    """Start ``command`` in a session of its own (as a terminal's job: its own process group) and
    return the processes the inner test reports once they all run."""
    log = (project / "out" / "run.log").open("wb")
    run = subprocess.Popen(
        command, cwd=project, env=_env(project), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    runs.append(run)
    pids = project / "out" / "pids.json"

    def reported() -> bool:
        assert run.poll() is None, (project / "out" / "run.log").read_text()[-3000:]
        return pids.exists()

    wait_until(reported, timeout=120, what="the inner test's processes running")
    found = {name: Proc.of(pid) for name, pid in json.loads(pids.read_text()).items()}
    assert all(found.values()), found
    procs = {name: proc for name, proc in found.items() if proc is not None}
    # A descendant is recorded within a second (SCAN_EVERY_S) of its start: before that, a
    # grandchild whose parent dies first would be out of reach.
    registry = project / "registry"
    wait_until(
        lambda: {f.name for f in registry.rglob("*")} >= {p.name for p in procs.values()},
        timeout=10,
        what="every process of the inner test recorded",
    )
    return procs


def _survivors(procs: dict[str, Proc]) -> list[str]:
    return [name for name, proc in procs.items() if proc.running()]


def _pytest(*extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "tests"]


@pytest.mark.parametrize(
    ("workers", "sig"),
    [
        pytest.param([], signal.SIGINT, id="serial-sigint"),
        pytest.param([], signal.SIGTERM, id="serial-sigterm"),
        pytest.param(["-n", "2"], signal.SIGINT, id="xdist-sigint"),
        pytest.param(["-n", "2"], signal.SIGTERM, id="xdist-sigterm"),
    ],
)
def test_a_signal_to_pytest_alone_ends_every_process_the_run_started(
    project: Path, started: list[subprocess.Popen[bytes]], workers: list[str], sig: signal.Signals
) -> None:
    """The signal goes to the pytest process only (``kill -INT PID``): under pytest-xdist its workers
    and their children never see it."""
    procs = _start(project, started, _pytest(*workers))
    run = started[0]
    run.send_signal(sig)
    run.wait(patient(60))
    wait_until(lambda: not _survivors(procs), timeout=10, what=f"no survivor of {procs}")
    assert not (project / "registry").exists() or not any((project / "registry").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_make_interrupted_ends_every_process_the_run_started(
    project: Path, started: list[subprocess.Popen[bytes]], sig: signal.Signals
) -> None:
    """Ctrl-C at a terminal signals make's whole process group; SIGTERM (``kill PID``) make alone,
    which passes it on to its recipe."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    procs = _start(project, started, ["make", "--no-print-directory", "pytest", "ARGS=-n 2"])
    make = started[0]
    if sig is signal.SIGINT:
        os.killpg(make.pid, sig)
    else:
        make.send_signal(sig)
    assert make.wait(patient(60)) != 0
    wait_until(lambda: not _survivors(procs), timeout=10, what=f"no survivor of {procs}")


def test_what_a_killed_run_left_is_ended_when_the_next_run_starts(
    project: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    procs = _start(project, started, _pytest("-n", "2"))
    run = started[0]
    run.send_signal(signal.SIGKILL)  # the run's starter alone: nothing of it can clean up
    run.wait(patient(10))
    assert _survivors(procs) == list(procs)  # left behind, as a power cut or `kill -9` leaves them
    (project / "tests" / "test_inner.py").unlink()
    (project / "tests" / "test_quick.py").write_text("def test_quick():\n    pass\n")
    done = subprocess.run(
        _pytest(),
        cwd=project,
        env=_env(project),
        capture_output=True,
        text=True,
        timeout=patient(120),
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    wait_until(lambda: not _survivors(procs), timeout=10, what=f"no survivor of {procs}")


def _sleeper(tmp_path: Path, *, ignore_term: bool = False) -> subprocess.Popen[bytes]:
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += f"open({str(tmp_path / 'up')!r}, 'a').close()\ntime.sleep(3600)\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    wait_until((tmp_path / "up").exists, timeout=30, what="the sleeper up")
    (tmp_path / "up").unlink()
    return child


def test_end_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    child = _sleeper(tmp_path, ignore_term=True)
    proc = Proc.of(child.pid)
    assert proc is not None
    assert end([proc]) == [proc]
    assert child.wait(patient(10)) == -signal.SIGKILL


def test_the_sweep_leaves_a_live_runs_processes_alone(tmp_path: Path) -> None:
    root = tmp_path / "registry"
    starter, leftover = _sleeper(tmp_path), _sleeper(tmp_path)
    try:
        live, orphan = Proc.of(starter.pid), Proc.of(leftover.pid)
        assert live is not None
        assert orphan is not None
        (root / live.name / live.name).mkdir(parents=True)
        (root / live.name / live.name / orphan.name).touch()
        assert sweep(root) == []
        assert orphan.running()
        starter.kill()
        starter.wait(patient(10))
        assert sweep(root) == [orphan]  # its run's starter gone: a leftover
        assert leftover.wait(patient(10)) == -signal.SIGTERM
        assert list(root.iterdir()) == []
    finally:
        for child in (starter, leftover):
            child.kill()
            child.wait(patient(10))
