"""One way to check a lifecycle's transitions: a table of allowed moves, checked in one place.

The model slot, a loaded model, a camera source and a deployment job each have a small state
machine. Each keeps its own table (the table is the documentation of that lifecycle); this module
only makes them read and fail the same way. A table is a read-only mapping ``state -> states it may
change to``, complete (every state has a row, terminal ones an empty row), and an illegal move is a
bug in the agent, never bad input: :class:`IllegalTransitionError` is a ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransitionError(RuntimeError):
    """A state machine was asked for a move its table does not allow."""


class TransitionTable(Mapping[S, frozenset[S]], Generic[S]):
    """The allowed transitions of one lifecycle; ``kind`` names it in error messages."""

    def __init__(self, states: type[S], allowed: Mapping[S, Iterable[S]], *, kind: str = "") -> None:
        missing = [state.name for state in states if state not in allowed]
        if missing:
            raise ValueError(f"transition table for {states.__name__} has no row for {', '.join(missing)}")
        self._rows: dict[S, frozenset[S]] = {state: frozenset(allowed[state]) for state in states}
        self.kind = kind

    def __getitem__(self, state: S) -> frozenset[S]:
        return self._rows[state]

    def __iter__(self) -> Iterator[S]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def terminal(self) -> frozenset[S]:
        """States with no way out."""
        return frozenset(state for state, row in self._rows.items() if not row)

    def allows(self, old: S, new: S) -> bool:
        return new in self._rows[old]

    def check(self, old: S, new: S, who: str = "") -> None:
        """Raise :class:`IllegalTransitionError` unless ``old -> new`` is in the table."""
        if new in self._rows[old]:
            return
        prefix = f"{who}: " if who else ""
        noun = f"{self.kind} " if self.kind else ""
        raise IllegalTransitionError(f"{prefix}illegal {noun}transition {old.value} -> {new.value}")
