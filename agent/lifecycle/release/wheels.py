"""An agent release's wheels: whether this device can install them, and the cache that holds them by hash.

The cache (``releases/wheels/<sha256>/<file name>``) keeps every wheel of the releases on disk, so the
next release needs only the wheels that changed: :func:`held_wheels` names the hashes a job need not
fetch, and :meth:`WheelCache.take` reads the cache before it asks for a delivered file.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from agent.fsutil import atomic_writer, fsync_directory, sha256_file
from agent.lifecycle.release.layout import WHEELS
from agent.protocol.delivery_errors import AgentInstallFailedError
from agent.protocol.device_targets import AgentRelease, AgentWheel


def incompatible_because(release: AgentRelease) -> str | None:
    """Why this interpreter on this machine cannot run ``release``; None when it can."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if release.python != here:
        return f"the release is for Python {release.python}; this device runs Python {here}"
    machine = platform.machine()
    if machine not in release.platforms:
        return f"the release is for {', '.join(release.platforms)}; this device is {machine}"
    supported = set(sys_tags())
    names = set()
    for wheel in release.wheels:
        try:
            name, version, _build, tags = parse_wheel_filename(wheel.filename)
        except InvalidWheelFilename as exc:
            return f"{wheel.filename}: {exc}"
        if not tags & supported:
            wanted = ", ".join(sorted(str(tag) for tag in tags))
            return f"{wheel.filename} cannot be installed here (its tags: {wanted})"
        names.add((name, str(version)))
    if (canonicalize_name(release.distribution), release.version) not in names:
        return f"no wheel of {release.distribution} {release.version} in the release"
    return None


class WheelCache:
    """Every wheel held, each checked against its SHA-256 on the way in and again before use."""

    def __init__(self, releases_root: Path) -> None:
        self.root = Path(releases_root) / WHEELS

    def path(self, wheel: AgentWheel) -> Path:
        return self.root / wheel.sha256 / wheel.filename

    def held(self) -> frozenset[str]:
        """The SHA-256 of every wheel held."""
        if not self.root.is_dir():
            return frozenset()
        return frozenset(entry.name for entry in self.root.iterdir() if any(entry.glob("*.whl")))

    def take(self, wheel: AgentWheel, artifacts: Mapping[str, Path]) -> Path:
        """The checked file of ``wheel``: held already, or the delivered one, checked and kept."""
        held = self.path(wheel)
        if held.is_file():
            if sha256_file(held) == wheel.sha256:
                return held
            held.unlink()
        delivered = artifacts.get(wheel.filename)
        if delivered is None:
            raise AgentInstallFailedError(f"{wheel.filename} was neither delivered nor held by this device")
        if sha256_file(delivered) != wheel.sha256:
            raise AgentInstallFailedError(f"{wheel.filename}: its SHA-256 is not the release's")
        held.parent.mkdir(parents=True, exist_ok=True)
        with atomic_writer(held) as out, open(delivered, "rb") as source:
            shutil.copyfileobj(source, out)
        return held

    def keep_only(self, hashes: Iterable[str]) -> None:
        """Remove every wheel not in ``hashes`` (those of the releases still on disk)."""
        keep = set(hashes)
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)
        fsync_directory(self.root)


def held_wheels(state_dir: Path) -> frozenset[str]:
    """The SHA-256 of every agent wheel this device holds: a job need not fetch those artifacts."""
    return WheelCache(Path(state_dir) / "releases").held()


def link_or_copy(source: Path, destination: Path) -> None:
    """``destination`` with ``source``'s bytes: a hard link when both share a file system."""
    with contextlib.suppress(FileNotFoundError):
        destination.unlink()
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)
