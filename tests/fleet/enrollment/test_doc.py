"""docs/enrollment.md's desk sections are what the code does: every code the desk answers is in the
table, the controller's ``enrollment:`` example is the settings' defaults, the registered file
example reads, and the refusals the tests provoke are the ones documented."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import yaml

from agent.fleet.enrollment.registered_file import read_registered_file
from agent.fleet.enrollment.settings import EnrollmentSettings

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "enrollment.md").read_text()
SOURCES = [ROOT / "agent" / "fleet" / "enrollment" / name for name in ("desk.py", "admission.py")]


def _yaml_blocks() -> list[str]:
    """The operator side's YAML examples (the device's side, later in the page, has its own test)."""
    operator_side = DOC.split("## The device's side", 1)[0]
    return [textwrap.dedent(b) for b in re.findall(r"^ *```yaml\n(.*?)^ *```", operator_side, re.S | re.M)]


def test_every_code_the_desk_answers_is_in_the_table() -> None:
    source = "\n".join(p.read_text() for p in SOURCES)
    codes = set(re.findall(r'(?:_Refusal|AdmissionError)\(\s*"([a-z_]+)"', source))
    codes |= set(re.findall(r'Verdict\(\s*"\w+",\s*"([a-z_]+)"', source))
    codes |= set(re.findall(r'_needs_reenroll\(\s*\w+,\s*\w+,\s*\w+,\s*"([a-z_]+)"', source))
    assert {
        "pending_full",
        "claim_used_up",
        "id_contested",
        "already_enrolled",
        "revoked",
        "too_soon",
    } <= codes
    table = DOC.split("## What each code means", 1)[1].split("\n## ", 1)[0]
    for code in codes:
        assert f"`{code}`" in table, code


def test_the_controller_example_is_the_defaults_and_the_registered_file_example_reads(tmp_path: Path) -> None:
    [controller, registered] = _yaml_blocks()
    shown = yaml.safe_load(controller)["enrollment"]
    defaults = EnrollmentSettings().model_dump()
    assert {k: v for k, v in shown.items() if k not in ("ca_dir", "registered_file")} == {
        k: v for k, v in defaults.items() if k not in ("ca_dir", "registered_file")
    }
    assert set(shown) == set(defaults)
    path = tmp_path / "registered.yaml"
    path.write_text(registered)
    assert read_registered_file(path) == [
        ("cam-entrance-01", "1423021000123"),
        (None, "1423021000124"),
        ("cam-dock-02", None),
    ]
