"""The README's two first commands: what `make demo` and `make test` would run (``make -n``), and what
tools/os-deps.sh would install for each (``--plan``), without installing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.camera.rtsp_camera import rtsp_server_missing
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[1]
OS_DEPS = REPO / "tools" / "os-deps.sh"
#: The apt packages only the tests use (their tools: gst-launch-1.0, prometheus, Alertmanager,
#: chromium, nginx).
TEST_ONLY = {
    "gstreamer1.0-tools",
    "gstreamer1.0-plugins-base",
    "gstreamer1.0-plugins-good",
    "prometheus",
    "prometheus-alertmanager",
    "chromium",
    "gstreamer1.0-plugins-ugly",
    "gstreamer1.0-plugins-bad",
    "ffmpeg",
    "python3-gi",
    "gir1.2-gst-rtsp-server-1.0",
    "nginx",
}

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed here")


def dry_run(target: str, venv: Path, *extra: str, environ: dict[str, str] | None = None) -> list[str]:
    """The commands ``make TARGET`` would run on a clean checkout (-B: every step out of date), with
    ``environ`` added to this environment."""
    # Run from `make test` itself, the inherited MAKELEVEL/MAKEFLAGS would make this a sub-make
    # that prints "Entering directory": it is asked as a user would ask it, at the top level. An
    # inherited PYTEST_WORKERS (`PYTEST_WORKERS=2 make test`) would hide the counted default.
    inherited = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "PYTEST_WORKERS")
    env = {k: v for k, v in os.environ.items() if k not in inherited} | (environ or {})
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", target, f"VENV={venv}", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=True,
    )
    return done.stdout.splitlines()


@needs_make
def test_make_demo_installs_the_agent_alone_and_says_each_step(tmp_path: Path) -> None:
    commands = dry_run("demo", tmp_path / "venv")
    assert commands[0] == "./tools/os-deps.sh demo"
    pip = [c for c in commands if " -m pip install" in c]
    assert pip == [
        f"{tmp_path}/venv/bin/python -m pip install --progress-bar on --upgrade pip",
        f"{tmp_path}/venv/bin/python -m pip install --progress-bar on -e .",
    ]
    # Each step is announced before it runs: an echo right before every pip, venv and demo command.
    for i, command in enumerate(commands):
        if " -m pip install" in command or " -m venv " in command or command.endswith("edge-agent demo"):
            assert commands[i - 1].startswith('echo "== make: '), command


@needs_make
def test_make_test_adds_the_test_tools(tmp_path: Path) -> None:
    commands = dry_run("test", tmp_path / "venv")
    assert commands[0] == "./tools/os-deps.sh test"
    assert f"{tmp_path}/venv/bin/python -m pip install --progress-bar on -e '.[dev,fleet]'" in commands
    assert not any(" -q" in c for c in commands if " -m pip install" in c)


@needs_make
def test_make_test_runs_the_suite_on_workers_that_keep_each_group_together(tmp_path: Path) -> None:
    """docs/testing.md: as many workers as tools/pytest_workers.py counts for this machine, and --dist
    loadgroup, without which pytest-xdist ignores the xdist_group marks that keep tests apart;
    PYTEST_WORKERS=N overrides the count (0: in one process), from make's command line or the environment."""
    counted = subprocess.run(
        [sys.executable, str(REPO / "tools" / "pytest_workers.py")],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=True,
    ).stdout.strip()
    assert int(counted) >= 1, counted
    pytest_line = f"{tmp_path}/venv/bin/python -m pytest -q -n {counted} --dist loadgroup"
    assert pytest_line in dry_run("test", tmp_path / "venv")
    serial = dry_run("pytest", tmp_path / "venv", "PYTEST_WORKERS=0")
    assert pytest_line.replace(f"-n {counted}", "-n 0") in serial
    from_environment = dry_run("pytest", tmp_path / "venv", environ={"PYTEST_WORKERS": "3"})
    assert pytest_line.replace(f"-n {counted}", "-n 3") in from_environment


def plan(target: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``os-deps.sh TARGET --plan`` with only ``path`` (holding python3) on PATH: every tool the script
    looks up on PATH is missing, as on a fresh machine."""
    return subprocess.run(
        ["/bin/bash", str(OS_DEPS), target, "--plan"],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
        env={"PATH": str(path), "PYTHON": sys.executable},
    )


def planned(output: str) -> set[str]:
    """The package names of the plan's "  pkg pkg : reason" lines."""
    return {pkg for line in output.splitlines() if " : " in line for pkg in line.split(" : ")[0].split()}


def test_the_demo_plan_never_holds_a_test_tool_and_the_test_plan_does(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python3")

    demo = plan("demo", bare)
    assert demo.returncode == 0, demo.stderr
    assert not planned(demo.stdout) & TEST_ONLY
    # mosquitto is found in /usr/sbin without PATH (Debian puts it there): then only python3-venv
    # may be missing, and only where ensurepip is.
    assert planned(demo.stdout) <= {"mosquitto", "python3-venv"}

    test = plan("test", bare)
    assert test.returncode == 0, test.stderr
    expected = {
        "gstreamer1.0-tools",
        "gstreamer1.0-plugins-base",
        "gstreamer1.0-plugins-good",
        "prometheus",
        "prometheus-alertmanager",
    }
    # The RTSP test cameras: encoders looked up through gst-inspect-1.0 and ffmpeg on PATH (missing
    # here), gst-rtsp-server through the system python3 at its absolute path.
    expected |= {"gstreamer1.0-plugins-ugly", "gstreamer1.0-plugins-bad", "ffmpeg"}
    if rtsp_server_missing() is not None:
        expected |= {"python3-gi", "gir1.2-gst-rtsp-server-1.0"}
    if not os.access("/usr/bin/chromium", os.X_OK):
        expected.add("chromium")
    if not os.access("/usr/sbin/nginx", os.X_OK):
        expected.add("nginx")
    assert planned(test.stdout) - planned(demo.stdout) == expected
    # Said before anything is installed: the flags, and why each package is there.
    assert "--no-install-recommends; no service started or enabled" in test.stdout
    assert "gst-launch-1.0: the GStreamer camera source" in test.stdout


def test_an_unknown_target_is_a_usage_line() -> None:
    done = subprocess.run(
        ["/bin/bash", str(OS_DEPS), "everything"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith("demo|test [--plan]")
