"""A real small filesystem for disk-full tests: a tmpfs mounted for one test, and filled to 0 bytes free."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. ``"16m"``) on ``mount_point``; skip the test without root."""
    mount_point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk-full case needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until ``disk`` has 0 bytes free; return it (unlink it to give the space back)."""
    filler = disk / "filler"
    errors = set()
    with filler.open("wb", buffering=0) as f:
        for block in (1024 * 1024, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as exc:
                errors.add(exc.errno)
    assert errors == {errno.ENOSPC}
    assert os.statvfs(disk).f_bavail == 0
    return filler
