"""Every command of ``edge-agent`` and its options, read from the real argparse parsers (for the
docs/cli.md table test)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from agent.cli import _parser
from agent.flag_aliases import DeprecatedAlias


def commands(
    parser: argparse.ArgumentParser | None = None, path: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``"fleet rollout start"``, its parser) for every leaf command."""
    parser = parser or _parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from commands(child, f"{path} {name}".strip())


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The options (not positionals, not -h) of one command, aliases included."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def is_alias(action: argparse.Action) -> bool:
    return isinstance(action, DeprecatedAlias)
