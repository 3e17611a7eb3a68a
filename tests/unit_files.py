"""systemd unit files as shipped, checked by systemd itself (no tests here)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

from tests.waiting import patient

#: How the shipped units start: the controller from its venv, the device agent's launcher from its last
#: confirmed release (docs/agent-updates.md).
SHIPPED_EXECS = (
    "ExecStart=/opt/edge-agent/.venv/bin/edge-agent ",
    "ExecStart=/var/lib/edge-agent/releases/good/bin/python ",
)


def read_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def analyze_verify(unit: Path, tmp_path: Path) -> str:
    """``systemd-analyze verify`` of ``unit``; its output, after asserting it found nothing to say.

    verify checks that ExecStart's binary exists; the venv is not installed on the test machine,
    so it is pointed at an executable that is. Every other line is verified as shipped.
    """
    text = unit.read_text()
    [shipped] = [start for start in SHIPPED_EXECS if start in text]
    assert text.count(shipped) == 1
    copy = tmp_path / unit.name
    copy.write_text(text.replace(shipped, f"ExecStart={shutil.which('true')} "))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Unknown or misspelt keys are only warnings ("Unknown key ..., ignoring"): fail on them too.
    assert unit.name not in output, output
    return output
