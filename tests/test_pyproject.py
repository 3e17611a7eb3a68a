"""pyproject.toml: what ``pip install`` makes of it, read the way pip reads it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_building_the_package_warns_about_nothing(tmp_path: Path) -> None:
    """pip builds in an isolated environment with the newest setuptools the build-system allows, as
    a fresh ``make venv`` does; every deprecation it prints is a warning a new user reads (the
    license table printed three). Needs the package index (or pip's cache) for setuptools."""
    project = tmp_path / "project"
    (project / "agent").mkdir(parents=True)
    # Only what the metadata needs: the package's files do not change what setuptools warns about.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    (project / "agent" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheel"), str(project)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "deprecated" not in output.lower(), output[-3000:]
    assert "Warning" not in output, output[-3000:]
