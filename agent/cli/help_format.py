"""How every ``edge-agent`` command prints its ``--help``: each option with its default.

The parser class is given to the top parser only; argparse makes every sub-parser (``fleet``,
``fleet rollout start`` ...) of the same class, so no command can forget the formatter.
"""

from __future__ import annotations

import argparse
from typing import Any


def shown_default(value: object) -> str:
    """A default as ``--help`` writes it: ``600`` for 600.0, lists comma-separated."""
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def meaningful_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should say the default: a value, not "unset" (None, False, an empty list)."""
    default = action.default
    if default is argparse.SUPPRESS or default is None or default is False or default == []:
        return False
    return bool(action.option_strings) and action.help not in (None, argparse.SUPPRESS)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Like :class:`argparse.ArgumentDefaultsHelpFormatter`, but silent about unset defaults (None,
    False, []) and about help texts that already say their default in their own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or not meaningful_default(action) or "default" in text:
            return text
        # The figure is written out here rather than as %(default)s, so 600.0 reads 600: escape
        # any % of it, since argparse expands the whole text with %-formatting afterwards.
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser that shows defaults in ``--help``; its sub-parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
