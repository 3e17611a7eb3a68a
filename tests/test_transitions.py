"""The shared transition table: complete rows, terminal states, one error for an illegal move."""

from __future__ import annotations

from enum import Enum

import pytest

from agent.transitions import IllegalTransitionError, TransitionTable


class Door(str, Enum):
    OPEN = "open"
    SHUT = "shut"
    GONE = "gone"


TABLE = TransitionTable(
    Door, {Door.OPEN: {Door.SHUT}, Door.SHUT: {Door.OPEN, Door.GONE}, Door.GONE: ()}, kind="door"
)


def test_a_table_reads_as_a_mapping_of_frozen_rows() -> None:
    assert TABLE[Door.SHUT] == frozenset({Door.OPEN, Door.GONE})
    assert set(TABLE) == set(Door)
    assert len(TABLE) == 3
    assert TABLE.terminal == frozenset({Door.GONE})


def test_allowed_moves_pass_and_others_raise_a_runtime_error_naming_both_states() -> None:
    TABLE.check(Door.OPEN, Door.SHUT)
    assert TABLE.allows(Door.SHUT, Door.GONE)
    assert not TABLE.allows(Door.OPEN, Door.GONE)
    with pytest.raises(IllegalTransitionError, match=r"^front: illegal door transition open -> gone$"):
        TABLE.check(Door.OPEN, Door.GONE, who="front")
    with pytest.raises(RuntimeError, match=r"^illegal door transition gone -> open$"):
        TABLE.check(Door.GONE, Door.OPEN)


def test_a_table_missing_a_state_is_refused_when_it_is_made() -> None:
    with pytest.raises(ValueError, match="no row for GONE"):
        TransitionTable(Door, {Door.OPEN: {Door.SHUT}, Door.SHUT: {Door.OPEN}})
