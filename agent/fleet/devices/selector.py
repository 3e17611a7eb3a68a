"""Device selectors: Kubernetes-style label selectors plus comparisons on what a device reports.

Pure: :func:`parse_selector` turns the text of ``--select`` into a :class:`Selector`, and
:meth:`Selector.matches` checks it against one device's :class:`DeviceFacts` (from its retained
``up/info``). No I/O here; the fleet commands collect the facts (:mod:`agent.fleet.devices.targets`).

The grammar (docs/fleet.md "Selecting devices")::

    selector    := requirement ("," requirement)*          (comma = AND)
    requirement := KEY | "!" KEY                            (has the key / has it not)
                 | KEY ("=" | "==" | "!=") VALUE
                 | KEY ("in" | "notin") "(" VALUE ("," VALUE)* ")"
                 | KEY (">" | ">=" | "<" | "<=") NUMBER     (numbers and versions: 2, 0.2, 8.6.2)

A KEY is a label key from the device's config (``site``, ``example.com/camera``), a platform fact
(``platform.dla_cores``, ``platform.l4t_release``: any key of ``up/info``'s ``platform``), or
``agent.version``. As in Kubernetes, ``!=`` and ``notin`` also match a device without the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent.errors import UsageError
from agent.names import label_key_problem, label_value_problem

Operator = Literal["exists", "!exists", "=", "!=", "in", "notin", ">", ">=", "<", "<="]

#: Keys under ``agent.`` a selector may name (what ``up/info`` says about the agent itself).
AGENT_KEYS = ("agent.version",)
#: A platform fact's name: what agent.machine.platform.platform_summary writes (``dla_cores``,
#: ``l4t_release``).
_PLATFORM_NAME = re.compile(r"^[a-z0-9_]{1,64}$")
#: A number or a version: digits separated by single dots (``2``, ``0.2``, ``8.6.2``).
_NUMBER = re.compile(r"^[0-9]+(\.[0-9]+)*$")
#: Characters of a key or a value token; everything else is an operator, a bracket or an error.
_WORD = re.compile(r"[A-Za-z0-9_./-]+")
_OPERATORS = ("==", "!=", ">=", "<=", "=", ">", "<")  # longest first
_COMPARISONS: dict[str, Operator] = {">": ">", ">=": ">=", "<": "<", "<=": "<="}


class SelectorError(UsageError):
    """A ``--select`` text that does not parse; the message names the column and shows it."""

    def __init__(self, text: str, column: int, what: str) -> None:
        self.text, self.column, self.what = text, column, what
        message = f"--select: at column {column}: {what}"
        # The CLI prints each problem after the same "error: ", so the caret lines up with the text.
        super().__init__(message, [message, f"  {text}", "  " + " " * (column - 1) + "^"])


@dataclass(frozen=True)
class DeviceFacts:
    """What a selector is checked against: one device's labels, platform facts and agent version."""

    device: str
    labels: Mapping[str, str] = field(default_factory=dict)
    platform: Mapping[str, object] = field(default_factory=dict)
    agent_version: str | None = None

    def value(self, key: str) -> str | None:
        """The device's value for ``key`` as text (None: the device does not have it)."""
        if key == "agent.version":
            return self.agent_version
        if key.startswith("platform."):
            raw = self.platform.get(key.removeprefix("platform."))
            if raw is None:
                return None  # a fact the device could not read is reported as null: not there
            if isinstance(raw, bool):
                return "true" if raw else "false"  # as the JSON of up/info spells it
            return str(raw)
        return self.labels.get(key)


@dataclass(frozen=True)
class Requirement:
    """One comma-separated part of a selector."""

    key: str
    op: Operator
    values: tuple[str, ...] = ()

    def matches(self, facts: DeviceFacts) -> bool:
        """Whether the device ``facts`` describe meets this requirement."""
        have = facts.value(self.key)
        if self.op == "exists":
            return have is not None
        if self.op == "!exists":
            return have is None
        if self.op in ("!=", "notin"):
            return have is None or have not in self.values
        if have is None:
            return False
        if self.op in ("=", "in"):
            return have in self.values
        return _compare(have, self.op, self.values[0])

    def __str__(self) -> str:
        if self.op == "exists":
            return self.key
        if self.op == "!exists":
            return f"!{self.key}"
        if self.op in ("in", "notin"):
            return f"{self.key} {self.op} ({','.join(self.values)})"
        return f"{self.key}{self.op}{self.values[0]}"


@dataclass(frozen=True)
class Selector:
    """Requirements that must all hold (comma = AND)."""

    requirements: tuple[Requirement, ...]

    def matches(self, facts: DeviceFacts) -> bool:
        """Whether every requirement holds for the device ``facts`` describe."""
        return all(r.matches(facts) for r in self.requirements)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.requirements)


def _number(text: str) -> tuple[int, ...] | None:
    """``8.6.2`` as ``(8, 6, 2)``; None for anything else (``0.2.0rc1``, ``Orin NX``)."""
    return tuple(int(part) for part in text.split(".")) if _NUMBER.match(text) else None


def _compare(have: str, op: str, want: str) -> bool:
    """``have op want`` as versions: part by part, missing parts count as 0 (``0.2`` = ``0.2.0``).

    A device value that is not plain digits and dots (a pre-release ``0.2.0rc1``, a board name)
    matches no comparison: a rollout must not reach a device on a guess about its version.
    """
    left = _number(have)
    right = _number(want)
    if left is None or right is None:
        return False
    width = max(len(left), len(right))
    left += (0,) * (width - len(left))
    right += (0,) * (width - len(right))
    return {">": left > right, ">=": left >= right, "<": left < right, "<=": left <= right}[op]


class _Reader:
    """A cursor over the selector text that reports errors by column (1-based)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str, pos: int | None = None) -> SelectorError:
        return SelectorError(self.text, (self.pos if pos is None else pos) + 1, what)

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def at_end(self) -> bool:
        self.skip_space()
        return self.pos >= len(self.text)

    def peek(self, token: str) -> bool:
        self.skip_space()
        return self.text.startswith(token, self.pos)

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "the end"

    def word(self, expected: str) -> tuple[str, int]:
        self.skip_space()
        match = _WORD.match(self.text, self.pos)
        if not match:
            raise self.fail(f"expected {expected}, found {self.found()}")
        self.pos = match.end()
        return match.group(), match.start()

    def operator(self) -> str | None:
        self.skip_space()
        for op in _OPERATORS:
            if self.text.startswith(op, self.pos):
                self.pos += len(op)
                return op
        return None


def parse_selector(text: str) -> Selector:
    """The selector ``text`` says; a :class:`SelectorError` naming the column where it goes wrong."""
    reader = _Reader(text)
    if reader.at_end():
        raise reader.fail("empty selector (to select every device, use `agent.version`)")
    requirements = [_requirement(reader)]
    while not reader.at_end():
        if not reader.peek(","):
            raise reader.fail(f"expected ',' or the end, found {reader.found()}")
        reader.pos += 1
        requirements.append(_requirement(reader))
    return Selector(tuple(requirements))


def _requirement(reader: _Reader) -> Requirement:
    if reader.peek("!") and not reader.peek("!="):
        reader.pos += 1
        return Requirement(_key(reader), "!exists")
    key = _key(reader)
    if reader.at_end() or reader.peek(","):
        return Requirement(key, "exists")
    op = reader.operator()
    if op is not None:
        value, start = _value(reader)
        if op in ("=", "==", "!="):
            _check_value(reader, key, value, start)
            return Requirement(key, "!=" if op == "!=" else "=", (value,))
        if _number(value) is None:
            raise reader.fail(f"{op} compares numbers or versions (2, 0.2, 8.6.2), not {value!r}", start)
        return Requirement(key, _COMPARISONS[op], (value,))
    word, start = reader.word(f"an operator (=, ==, !=, in, notin, >, >=, <, <=) after {key!r}")
    if word not in ("in", "notin"):
        raise reader.fail(f"expected an operator (=, ==, !=, in, notin, >, >=, <, <=), found {word!r}", start)
    return Requirement(key, "in" if word == "in" else "notin", _value_set(reader, key))


def _key(reader: _Reader) -> str:
    key, start = reader.word("a key (a label, platform.NAME or agent.version)")
    if key.startswith("platform."):
        if not _PLATFORM_NAME.match(key.removeprefix("platform.")):
            raise reader.fail(f"{key!r}: a platform key is platform.NAME, NAME in a-z, 0-9 and '_'", start)
    elif key.startswith("agent."):
        if key not in AGENT_KEYS:
            raise reader.fail(f"unknown key {key!r} (agent keys: {', '.join(AGENT_KEYS)})", start)
    elif problem := label_key_problem(key):
        raise reader.fail(problem, start)
    return key


def _value(reader: _Reader) -> tuple[str, int]:
    reader.skip_space()
    start = reader.pos
    match = _WORD.match(reader.text, reader.pos)
    if not match:
        # An empty value is a valid label value (`camera=`), but not before a stray character.
        if reader.at_end() or reader.peek(",") or reader.peek(")"):
            return "", start
        raise reader.fail(f"expected a value, found {reader.found()}")
    reader.pos = match.end()
    return match.group(), start


def _check_value(reader: _Reader, key: str, value: str, start: int) -> None:
    """A label value that breaks the label rules could never match: say so instead."""
    if key.startswith(("platform.", "agent.")):
        return  # device facts are not labels: `platform.jetpack=6.0` and the like are fine
    if problem := label_value_problem(value):
        raise reader.fail(problem, start)


def _value_set(reader: _Reader, key: str) -> tuple[str, ...]:
    if not reader.peek("("):
        raise reader.fail(f"expected '(' to open the set of values, found {reader.found()}")
    reader.pos += 1
    values: list[str] = []
    while True:
        value, start = _value(reader)
        if not value:
            raise reader.fail("expected a value in the set (empty values are not allowed there)", start)
        _check_value(reader, key, value, start)
        values.append(value)
        if reader.peek(")"):
            reader.pos += 1
            return tuple(dict.fromkeys(values))
        if not reader.peek(","):
            what = "the end" if reader.at_end() else repr(reader.text[reader.pos])
            raise reader.fail(f"expected ',' or ')' in the set of values, found {what}")
        reader.pos += 1
