"""An agent release made from a directory of wheels, and read back for a rollout or a signature.

``fleet agent release WHEEL_DIR --version V`` writes :data:`RELEASE_FILE` beside the wheels: the
:class:`~agent.protocol.device_targets.AgentRelease` naming every wheel by name, size and SHA-256,
the Python minor version and the machines it runs on (given, or read from the wheels' tags). That
file's bytes are what an ``_agent`` desired state delivers and what a release key signs; the
wheels travel beside it as the manifest's ``wheel`` artifacts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes, sha256_file
from agent.protocol.device_targets import (
    MAX_AGENT_RELEASE_BYTES,
    MAX_RELEASE_WHEELS,
    WHEEL_FILENAME,
    AgentRelease,
    AgentWheel,
)

#: The release document's name in a release directory.
RELEASE_FILE = "agent-release.json"
#: A CPython tag naming one minor version (cp310, cp39).
_CPYTHON_TAG = re.compile(r"^cp3(\d{1,2})$")
#: Machines a platform tag names (manylinux_2_17_aarch64, linux_x86_64, ...).
_MACHINES = ("aarch64", "x86_64")


@dataclass(frozen=True)
class ReleaseDir:
    """A release directory read back: its document's bytes and model, and each wheel's file."""

    document: Path
    release: AgentRelease
    wheels: tuple[tuple[str, Path], ...]  # (file name, path), in the document's order


def wheel_tags(filename: str) -> tuple[str, str, str]:
    """The python, abi and platform tags of a wheel file name (ConfigError when it is not one)."""
    match = WHEEL_FILENAME.match(filename)
    if match is None:
        raise ConfigError(f"{filename!r} is not a wheel file name (name-version-python-abi-platform.whl)")
    return match["python"], match["abi"], match["platform"]


def python_of(filenames: list[str]) -> str | None:
    """The one Python minor version the wheels' CPython tags name (None: all are pure ``py3`` or
    stable-ABI ``abi3``).

    ConfigError when two wheels are for different minor versions: no one interpreter runs both.
    """
    minors = set()
    for name in filenames:
        python, abi, _ = wheel_tags(name)
        if abi == "abi3":
            continue  # the stable ABI: cp37-abi3 runs on 3.7 and every later version
        for tag in python.split("."):
            match = _CPYTHON_TAG.match(tag)
            if match is not None:
                minors.add(f"3.{match[1]}")
    if len(minors) > 1:
        raise ConfigError(f"the wheels are for several Python versions ({', '.join(sorted(minors))})")
    return minors.pop() if minors else None


def platforms_of(filenames: list[str]) -> list[str]:
    """The machines the wheels' platform tags name (empty: all are ``any``).

    ConfigError when two wheels are for different machines.
    """
    machines: set[str] = set()
    for name in filenames:
        for tag in wheel_tags(name)[2].split("."):
            machines.update(m for m in _MACHINES if tag.endswith(m))
    if len(machines) > 1:
        raise ConfigError(f"the wheels are for several machines ({', '.join(sorted(machines))})")
    return sorted(machines)


def make_release(
    wheel_dir: Path, *, version: str, python: str | None = None, platforms: list[str] | None = None
) -> AgentRelease:
    """The release of every ``*.whl`` in ``wheel_dir`` (ConfigError naming what is missing or wrong)."""
    paths = sorted(wheel_dir.glob("*.whl"))
    if not paths:
        raise ConfigError(f"{wheel_dir}: no wheel (*.whl) in it; `pip wheel . -w {wheel_dir}` makes them")
    if len(paths) > MAX_RELEASE_WHEELS:
        raise ConfigError(
            f"{wheel_dir}: {len(paths)} wheels, more than the {MAX_RELEASE_WHEELS} a release holds"
        )
    names = [p.name for p in paths]
    python = python or python_of(names)
    if python is None:
        raise ConfigError(
            "every wheel is pure Python (py3): say which Python the release is for (--python 3.10)"
        )
    machines = platforms or platforms_of(names)
    if not machines:
        raise ConfigError(
            "every wheel runs anywhere (any): say which machines it is for (--platform aarch64)"
        )
    try:
        return AgentRelease(
            version=version,
            python=python,
            platforms=machines,
            wheels=[AgentWheel(filename=p.name, sha256=sha256_file(p), size=p.stat().st_size) for p in paths],
        )
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)
        ]
        raise ConfigError("cannot make the agent release", problems) from exc


def write_release(wheel_dir: Path, release: AgentRelease) -> Path:
    """Write ``release`` as :data:`RELEASE_FILE` in ``wheel_dir`` (temp + fsync + rename)."""
    path = wheel_dir / RELEASE_FILE
    atomic_write_bytes(path, release_bytes(release), mode=0o644)
    return path


def release_bytes(release: AgentRelease) -> bytes:
    """The document's bytes (compact JSON): what is hashed, signed and delivered."""
    return release.model_dump_json(exclude_none=True).encode("utf-8")


def read_release_dir(path: Path) -> ReleaseDir:
    """The release directory ``path`` (made by :func:`write_release`), every wheel checked against
    the document by size and SHA-256 (ConfigError naming the first that differs or is missing)."""
    document = path / RELEASE_FILE
    if not document.is_file():
        raise ConfigError(
            f"{path}: no {RELEASE_FILE}; `edge-agent fleet agent release {path} --version V` makes it"
        )
    data = document.read_bytes()
    if len(data) > MAX_AGENT_RELEASE_BYTES:
        raise ConfigError(
            f"{document}: larger than the {MAX_AGENT_RELEASE_BYTES} bytes a release document may be"
        )
    try:
        release = AgentRelease.model_validate_json(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)
        ]
        raise ConfigError(f"{document} is not an agent release", problems) from exc
    wheels = []
    for wheel in release.wheels:
        file = path / wheel.filename
        if not file.is_file():
            raise ConfigError(f"{path}: the release names {wheel.filename}, which is not in the directory")
        if file.stat().st_size != wheel.size or sha256_file(file) != wheel.sha256:
            raise ConfigError(
                f"{file}: not the wheel the release names (size or SHA-256 differ); make the release again"
            )
        wheels.append((wheel.filename, file))
    return ReleaseDir(document, release, tuple(wheels))
