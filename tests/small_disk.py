"""A real small filesystem (tmpfs) that a test can fill to 0 bytes free and free again; needs root."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallDisk:
    """A mounted tmpfs at ``path``; :meth:`fill` takes every free byte, :meth:`free` gives them back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / "filler"

    def fill(self) -> None:
        """Write a filler file until the filesystem says ENOSPC: 0 bytes free afterwards."""
        # Unbuffered: a buffered file would keep what did not fit and raise ENOSPC again on close.
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (64 * 1024, 1):  # big pieces, then whatever is left byte by byte
                with contextlib.suppress(OSError):  # ENOSPC: full
                    while True:
                        os.write(fd, b"\0" * size)
        finally:
            os.close(fd)
        assert self.free_bytes() == 0, f"{self.path} still has {self.free_bytes()} bytes free"

    def free(self) -> None:
        """Delete the filler: the space is back."""
        self._filler.unlink(missing_ok=True)

    def free_some(self, size: int) -> None:
        """Give ``size`` bytes of the filler back: a disk hovering at full (fill() takes them again)."""
        os.truncate(self._filler, max(0, self._filler.stat().st_size - size))

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def small_disk(path: Path, size: str = "8m") -> Iterator[SmallDisk]:
    """Mount a tmpfs of ``size`` at ``path`` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk case needs root")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
