"""The operator's pause/resume/abort refusals, for every rollout state (issue 22.6)."""

from __future__ import annotations

import pytest

from agent.fleet.rollout.actions import ACTION_TARGET, action_refusal
from agent.fleet.rollout.records import ROLLOUT_MOVES, RolloutState


@pytest.mark.parametrize("state", list(RolloutState))
@pytest.mark.parametrize("verb", list(ACTION_TARGET))
def test_a_refusal_exactly_where_the_store_would_refuse_and_never_in_its_words(
    verb: str, state: RolloutState
) -> None:
    refusal = action_refusal(verb, "r1", state)

    assert (refusal is None) == ROLLOUT_MOVES.allows(state, ACTION_TARGET[verb])
    if refusal is not None:
        assert "illegal" not in refusal
        assert "->" not in refusal
        assert refusal.startswith("rollout r1 ")


def test_the_refusals_say_what_is_possible() -> None:
    assert action_refusal("pause", "r1", RolloutState.PAUSED) == "rollout r1 is already PAUSED: nothing to do"
    assert action_refusal("resume", "r1", RolloutState.RUNNING) == (
        "rollout r1 is already RUNNING: nothing to do"
    )
    assert action_refusal("abort", "r1", RolloutState.DONE) == (
        "rollout r1 has ended (DONE): it cannot be aborted any more"
    )
