"""Real agent releases for the tests: this repository built as wheels, virtual environments, a service.

* :func:`build_wheel` copies the tree, sets another version (and, for a broken release, edits it) and
  builds it with ``pip wheel --no-deps --no-build-isolation`` (offline); the session keeps the wheels.
* The heavy dependencies (numpy, onnxruntime, OpenCV, pydantic...) are not installed again into every
  release: :func:`system_site` makes a directory of links to the test environment's packages, minus
  the agent itself and pip's own, and the processes get it on ``PYTHONPATH``: what JetPack's system
  site-packages are to a release on a Jetson (visible to it and to pip, installed by nobody's wheel).
  The agent's own wheel is really installed into each release, by pip, from the delivered files.
* :class:`Service` stands in for systemd's ``Restart=on-failure``: it runs the launcher from the
  ``good`` release and starts it again whenever it exits non-zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.lifecycle.release.layout import STOP_AT_ENV
from agent.protocol.device_targets import AgentRelease, AgentWheel
from agent.protocol.manifest import build_manifest, describe_artifact
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[3]
DEVICE = Path(__file__).with_name("device.py")
BASE_VERSION = "1.0.0"
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
#: What these tests scale down: a crash 3 s after import, against a confirmation after 6 s of health
#: (on a device: the 30 s crash of the issue against 60 s).
CRASH_S = 3.0
CONFIRM_S = 6.0


def build_wheel(out: Path, version: str, edit: Callable[[Path], None] | None = None) -> Path:
    """This repository's agent as a wheel of ``version``, after ``edit`` changed the copied tree."""
    tree = out / f"tree-{version}"
    shutil.copytree(REPO / "agent", tree / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md",):
        shutil.copy(REPO / name, tree / name)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert pyproject.count('version = "0.1.0"') == 1
    (tree / "pyproject.toml").write_text(pyproject.replace('version = "0.1.0"', f'version = "{version}"'))
    init = tree / "agent" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', f'__version__ = "{version}"'))
    if edit is not None:
        edit(tree)
    wheels = out / "wheels"
    pip_wheel(tree, wheels)
    shutil.rmtree(tree)
    [wheel] = wheels.glob(f"edge_agent-{version}-*.whl")
    return wheel


def failing_at_import(tree: Path) -> None:
    with open(tree / "agent" / "__init__.py", "a") as init:
        init.write('\nraise ImportError("this release fails at import on purpose (a test)")\n')


def crashing_later(tree: Path) -> None:
    with open(tree / "agent" / "__init__.py", "a") as init:
        init.write(
            "\nimport os as _os, threading as _threading\n"
            f"_crash = _threading.Timer({CRASH_S}, _os._exit, (1,))\n"
            "_crash.daemon = True\n_crash.start()\n"
        )


def needing(requirement: str) -> Callable[[Path], None]:
    """An edit that adds ``requirement`` to the agent's dependencies."""

    def edit(tree: Path) -> None:
        pyproject = tree / "pyproject.toml"
        text = pyproject.read_text()
        pyproject.write_text(
            text.replace("dependencies = [\n", f'dependencies = [\n    "{requirement}",\n', 1)
        )

    return edit


#: A dependency no wheel and no system package provides.
ABSENT = "edge-agent-absent-dependency>=1"
#: A small dependency of its own wheel, shared by two releases (what the cache keeps between them).
EXTRA = "edge-agent-test-extra==1.0"


def build_extra_wheel(out: Path) -> Path:
    """The wheel of :data:`EXTRA`: one module."""
    tree = out / "tree-extra"
    tree.mkdir()
    (tree / "edge_agent_test_extra.py").write_text('"""A dependency two test releases share."""\n')
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "edge-agent-test-extra"\nversion = "1.0"\n\n'
        '[tool.setuptools]\npy-modules = ["edge_agent_test_extra"]\n'
    )
    pip_wheel(tree, out / "wheels")
    [wheel] = (out / "wheels").glob("edge_agent_test_extra-1.0-*.whl")
    return wheel


def pip_wheel(tree: Path, wheels: Path) -> None:
    """Build ``tree`` into ``wheels`` offline, with this environment's setuptools."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run(
        [*command, "-q", "-w", str(wheels), str(tree)],
        capture_output=True,
        text=True,
        timeout=patient(120),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def system_site(out: Path) -> Path:
    """Links to the test environment's packages but the agent's and pip's: a Jetson's system site."""
    site = out / "system-site"
    site.mkdir()
    left_out = (
        "edge_agent",
        "__editable__",
        "pip",
        "setuptools",
        "_distutils_hack",
        "pkg_resources",
        "wheel",
    )
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(left_out) or entry.suffix == ".pth" or entry.name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    return site


def release_document(path: Path, version: str, wheels: list[Path], **fields: object) -> Path:
    """An AgentRelease of ``wheels`` (what the operator side would sign), written to ``path``."""
    described = [
        AgentWheel(filename=w.name, sha256=hashlib.sha256(w.read_bytes()).hexdigest(), size=w.stat().st_size)
        for w in wheels
    ]
    values: dict[str, object] = {"version": version, "python": HERE, "platforms": [platform.machine()]}
    values.update(fields)
    release = AgentRelease.model_validate({**values, "wheels": [w.model_dump() for w in described]})
    path.write_text(release.model_dump_json())
    return path


def write_job(state: Path, document: Path, wheels: list[Path], *, job_id: str, probation_s: float) -> None:
    """The job the device runs: the document as the manifest's bytes, every wheel as an artifact."""
    release = AgentRelease.model_validate_json(document.read_bytes())
    manifest = build_manifest(
        document,
        job_id=job_id,
        sequence=1,
        slot="_agent",
        model_id="edge-agent",
        version=release.version,
        probation_s=probation_s,
        artifacts=[describe_artifact(w, name=w.name, kind="wheel") for w in wheels],
    )
    job = {
        "document": str(document),
        "manifest": manifest.model_dump(mode="json"),
        "artifacts": {w.name: str(w) for w in wheels},
        "confirm_s": CONFIRM_S,
    }
    (state / "job.json").write_text(json.dumps(job))


def install_first(
    state: Path, wheel_dir: Path, env: dict[str, str], version: str = BASE_VERSION, *, adopt: bool = True
) -> Path:
    """The first install by hand (docs/operations.md): releases/<v>, then the launcher adopts it
    (without ``adopt``: only marked complete, as the target's install leaves a release)."""
    release = state / "releases" / version
    release.parent.mkdir(parents=True, exist_ok=True)
    python = str(release / "bin" / "python")
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(release)], env)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--find-links",
            str(wheel_dir),
            f"edge-agent=={version}",
        ],
        env,
    )
    if not adopt:
        (release / ".complete").write_text(json.dumps({"version": version, "wheels": []}))
        return release.parent
    run([python, "-I", "-m", "agent.lifecycle.release.launcher", str(release.parent), "--adopt"], env)
    return release.parent


def run(command: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=patient(120), check=False)
    assert done.returncode == 0, done.stdout + done.stderr


class Service:
    """systemd's ``Restart=on-failure`` for the tests: the launcher from ``good``, started again on failure.

    ``stop_at`` (a step name) is given to every start until one is killed there; then never again.
    """

    def __init__(
        self, state: Path, env: dict[str, str], *, stop_at: str | None = None, args: list[str] | None = None
    ) -> None:
        """``args``: what the launcher passes to the release's Python (default: the test device)."""
        self.state = state
        self.args = args if args is not None else [str(DEVICE), str(state)]
        self.releases = state / "releases"
        self.env = env
        self.stop_at = stop_at
        self.exits: list[int] = []
        self.log = open(state / "service.log", "ab")  # noqa: SIM115 (closed by stop)
        self.process: subprocess.Popen[bytes] | None = None
        self.on_kill: Callable[[], None] = lambda: None

    def start(self) -> None:
        env = dict(self.env)
        if self.stop_at is not None:
            env[STOP_AT_ENV] = self.stop_at
        launcher = [
            str(self.releases / "good" / "bin" / "python"),
            "-I",
            "-m",
            "agent.lifecycle.release.launcher",
        ]
        self.process = subprocess.Popen(
            [*launcher, str(self.releases), "--", *self.args],
            cwd=self.state,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def run_until(self, settled: Callable[[], bool], timeout: float, what: str) -> None:
        """Start, and start again after every failure, until ``settled`` holds while a process runs."""
        self.start()
        self.keep_until(settled, timeout, what)

    def keep_until(self, settled: Callable[[], bool], timeout: float, what: str) -> None:
        """Keep it running (started again after every failure) until ``settled`` holds while it runs."""

        def running_and_settled() -> bool:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                self.exits.append(code)
                assert code != 0, self.output()
                if code == -signal.SIGKILL:
                    self.stop_at = None
                    self.on_kill()
                self.start()
                return False
            return settled()

        wait_until(running_and_settled, timeout, f"{what} ({self.output()[-2000:]})")

    def run_until_done(self, timeout: float = 120.0) -> dict[str, object]:
        """Run until the job ended and the release that ended it serves."""
        self.run_until(
            lambda: (self.state / "done.json").exists() and self.serving_since_done(),
            timeout,
            "the job to end",
        )
        done: dict[str, object] = json.loads((self.state / "done.json").read_text())
        return done

    def serving_since_done(self) -> bool:
        """The process that runs now recorded its start and its info (after the job ended)."""
        assert self.process is not None
        infos = self.lines("infos.jsonl")
        return bool(infos) and infos[-1]["pid"] == self.process.pid

    def lines(self, name: str) -> list[dict[str, object]]:
        path = self.state / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def output(self) -> str:
        self.log.flush()
        return (self.state / "service.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=patient(30))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def fingerprint(release: Path) -> list[tuple[str, int]]:
    """A release's files and sizes (bytecode caches aside): what "untouched" compares."""
    return sorted(
        (str(path.relative_to(release)), path.lstat().st_size)
        for path in release.rglob("*")
        if "__pycache__" not in path.parts and not path.is_dir()
    )


def environment(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env["PYTHONPATH"] = str(site)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Built:
    wheels: dict[str, Path]
    site: Path


@dataclass
class Device:
    state: Path
    env: dict[str, str]
    delivered: Path
    built: Built

    @property
    def releases(self) -> Path:
        return self.state / "releases"

    def link(self, name: str) -> str:
        return (self.releases / name).readlink().name

    def deliver(
        self,
        version: str,
        *,
        job_id: str = "job-1",
        probation_s: float | None = None,
        others: tuple[str, ...] = (),
        others_held: bool = False,
        **fields: object,
    ) -> None:
        """The job of release ``version``: its document names the agent's wheel and ``others`` (keys of
        the built wheels); those are delivered too unless the device holds them (``others_held``)."""
        wheel = self.built.wheels[version]
        delivered = self.delivered / job_id
        delivered.mkdir()
        copy = delivered / wheel.name
        copy.write_bytes(wheel.read_bytes())
        listed = [copy, *(self.built.wheels[name] for name in others)]
        document = release_document(delivered / "release.json", version, listed, **fields)
        write_job(self.state, document, listed, job_id=job_id, probation_s=probation_s or patient(60))
        if others_held:  # the job runner skips the artifacts the device holds: install takes them by hash
            job = json.loads((self.state / "job.json").read_text())
            job["artifacts"] = {copy.name: str(copy)}
            (self.state / "job.json").write_text(json.dumps(job))
        (self.state / "done.json").unlink(missing_ok=True)

    def service(self, stop_at: str | None = None) -> Service:
        return Service(self.state, self.env, stop_at=stop_at)

    def service_with(self, args: list[str]) -> Service:
        """The service running ``args`` (the real agent: ``-m agent run -c FILE``), not the test device."""
        return Service(self.state, self.env, args=args)


def run_update(
    device: Device, stop_at: str | None = None, on_kill: Callable[[], None] | None = None
) -> tuple[dict[str, object], Service]:
    """Run the service until the job the device was given ended; stop it."""
    service = device.service(stop_at)
    if on_kill is not None:
        service.on_kill = on_kill
    try:
        return service.run_until_done(timeout=120), service
    finally:
        service.stop()
