"""docs/cli.md's one table of flags is the parsers' truth, and ``--help`` shows every default
(issue 22.5)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from agent.cli import _parser, main
from agent.cli.help_format import meaningful_default, shown_default
from agent.fleet.cli.main import FLEET_COMMANDS
from tests.cli.parser_walk import commands, is_alias, options

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
TOP_LEVEL = (
    "run",
    "check-config",
    "enroll",
    "import",
    "schema",
    "info",
    "build",
    "selftest",
    "broker",
    "fleet",
    "demo",
)
PARSERS = dict(commands())


def _expand(cell: str) -> list[str]:
    """The commands column: ``fleet deploy, cmd, rollout *`` -> the full command names."""
    out: list[str] = []
    for item in (part.strip() for part in cell.split(",")):
        name = item if item.split()[0] in TOP_LEVEL else f"fleet {item}"
        if name.endswith(" *"):
            stem = name[:-2]
            out += [c for c in PARSERS if c.startswith(f"{stem} ")]
        else:
            out.append(name)
    return out


def _table(heading: str) -> list[tuple[list[str], list[str], str]]:
    """(flags, commands, last cell) of each row of the table under ``## heading``."""
    section = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows.append((re.findall(r"`(-[^`]+)`", cells[0]), _expand(cells[1]), cells[2]))
    return rows


def _option_strings(command: str, *, aliases: bool) -> set[str]:
    return {s for a in options(PARSERS[command]) if is_alias(a) == aliases for s in a.option_strings}


def test_every_flag_in_the_table_exists_on_the_commands_it_names() -> None:
    rows = _table("Every flag")
    assert len(rows) > 50
    for flags, names, _meaning in rows:
        for name in names:
            assert name in PARSERS, f"docs/cli.md names a command that does not exist: {name}"
            missing = set(flags) - _option_strings(name, aliases=False)
            assert not missing, f"docs/cli.md: {name} has no {missing}"


def test_every_public_flag_of_every_command_is_in_the_table() -> None:
    documented = {
        (name, flag) for flags, names, _ in _table("Every flag") for name in names for flag in flags
    }
    for name in PARSERS:
        for flag in _option_strings(name, aliases=False):
            assert (name, flag) in documented, f"{name} {flag} is missing from docs/cli.md"


def test_every_old_name_is_in_the_table_and_parses_like_the_new_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _table("Renamed flags")
    documented = {(name, row[0][0]) for row in rows for name in row[1]}
    actual = {(name, flag) for name in PARSERS for flag in _option_strings(name, aliases=True)}
    assert documented == actual
    for (old,), names, new_cell in rows:
        [new] = re.findall(r"`(-[^`]+)`", new_cell)
        for name in names:
            parser = PARSERS[name]
            [alias] = [a for a in options(parser) if old in a.option_strings]
            [target] = [a for a in options(parser) if new in a.option_strings]
            assert alias.dest == target.dest, f"{name} {old} stores elsewhere than {new}"
            value = (target.choices and list(target.choices)[-1]) or "7"
            assert alias.type == target.type
            assert alias.choices == target.choices
            argv = [*name.split(), *_required(name), old, str(value)]
            parsed = _parser().parse_args(argv)
            convert: Any = target.type or str
            assert getattr(parsed, target.dest) == convert(str(value))
            assert f"{old} is an old name; use {new}" in capsys.readouterr().err


def _required(name: str) -> list[str]:
    """The least argv that makes ``name`` parse (its positionals and required options)."""
    argv: list[str] = []
    for action in PARSERS[name]._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            if action.nargs != "?":
                argv.append("x.onnx" if "MODEL" in str(action.metavar) else "x")
        elif action.required:
            argv += [action.option_strings[-1], "x"]
    for group in PARSERS[name]._mutually_exclusive_groups:
        if group.required:
            argv.append(next(a for a in group._group_actions if a.nargs == 0).option_strings[-1])
    return argv


def test_help_shows_every_default() -> None:
    for name, parser in PARSERS.items():
        text = parser.format_help()
        flat = " ".join(text.split())
        assert "%%" not in text, f"{name} --help shows an unexpanded %%"
        for action in options(parser):
            if is_alias(action):
                assert action.option_strings[0] not in text, f"{name} --help shows the old {action}"
                continue
            assert action.help, f"{name} {action.option_strings}: no help text"
            if meaningful_default(action):
                shown = shown_default(action.default)
                assert f"default: {shown}" in flat or f"default {shown}" in flat, (
                    f"{name} --help does not show the default of {action.option_strings[-1]} ({shown})"
                )


def test_help_of_the_issue_shows_timeout_max_failed_and_soak_defaults() -> None:
    deploy = " ".join(PARSERS["fleet deploy"].format_help().split())
    start = " ".join(PARSERS["fleet rollout start"].format_help().split())
    assert "(default: 600)" in deploy
    assert "(default: 0, the first stops the rollout)" in start
    assert "(default: 0, none)" in start


def test_edge_agent_help_lists_every_fleet_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert {n.split()[1] for n in PARSERS if n.startswith("fleet ")} == set(FLEET_COMMANDS)
    with pytest.raises(SystemExit):
        main(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert f"operator commands: {', '.join(FLEET_COMMANDS)}" in flat


def test_fleet_controller_help_says_what_it_serves_and_takes_dash_c(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["fleet", "controller", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for served in ("rollout API", "_controller/req", "chunks", "console", "/metrics"):
        assert served in flat
    assert _parser().parse_args(["fleet", "controller", "-c", "c.yaml"]).config == Path("c.yaml")
