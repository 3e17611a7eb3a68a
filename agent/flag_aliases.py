"""Old flag names kept working after a rename (docs/cli.md, "Renamed flags"): operators have scripts.

An alias is hidden from ``--help`` (the table in docs/cli.md lists it) and, when used, stores into
the new flag's destination and says once on stderr which name to use instead. Shared by
:mod:`agent.cli` (``build``) and :mod:`agent.fleet` (the fleet commands), so it lives below both.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class DeprecatedAlias(argparse.Action):
    """``--old VALUE``: stores like ``--new VALUE`` and warns on stderr that ``--new`` is the name."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new_flag: str, **kwargs: Any) -> None:
        self.new_flag = new_flag
        kwargs["help"] = argparse.SUPPRESS
        kwargs.setdefault("default", argparse.SUPPRESS)  # the new flag's default is the one that counts
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"warning: {option_string} is an old name; use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_alias(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: argparse.Action
) -> None:
    """Make ``old`` a hidden alias of the option ``new`` (same destination, type and choices)."""
    like: dict[str, Any] = {"choices": new.choices, "metavar": new.metavar}
    if new.type is not None:
        like["type"] = new.type
    parser.add_argument(old, action=DeprecatedAlias, dest=new.dest, new_flag=new.option_strings[-1], **like)
