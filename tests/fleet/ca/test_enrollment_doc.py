"""docs/enrollment.md shows what the code and configs/mosquitto/ really are: the config files
verbatim, the ACL ``fleet ca`` writes, every refusal code, commands that parse."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path
from typing import get_args

from agent.cli import _parser
from agent.fleet.ca.broker import devices_acl
from agent.fleet.ca.claims import ClaimCode
from agent.fleet.ca.csr import CsrCode

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "enrollment.md").read_text()


def blocks(language: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(rf"^ *```{language}\n(.*?)^ *```", DOC, re.S | re.M)]


def test_the_broker_configuration_shown_is_configs_mosquitto() -> None:
    assert blocks("conf") == [(ROOT / "configs" / "mosquitto" / "mosquitto.conf").read_text()]
    acls = blocks("acl")
    for name in ("enrollment.acl", "operators.acl"):
        assert (ROOT / "configs" / "mosquitto" / name).read_text() in acls, name
    assert devices_acl("fleet/v1", []) in acls
    assert devices_acl("fleet/v1", ["jet-7"]) in acls


def test_every_refusal_code_is_explained() -> None:
    for code in (*get_args(CsrCode), *get_args(ClaimCode)):
        assert f"| `{code}` |" in DOC, code


def test_every_command_shown_parses() -> None:
    commands = [
        line
        for block in blocks("sh")
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("edge-agent ")
    ]
    assert len(commands) >= 5
    for command in commands:
        argv = shlex.split(command, comments=True)[1:]
        _parser().parse_args(argv)


def test_every_test_the_threat_table_names_exists() -> None:
    section = DOC.split("## What each attacker can and cannot do", 1)[1]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`|`::(\w+)`", section)
    assert named
    current = ""
    for path, name, short in named:
        if path:
            current = path
        text = (ROOT / current).read_text()
        assert f"def {name or short}(" in text, f"{current}::{name or short}"
