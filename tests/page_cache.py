"""What of a file the kernel holds in its page cache: util-linux's ``fincore``, for the tests that a
download's early writeback keeps the file cached for the whole-file hash that follows it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())
