"""What an operator's ``pause``, ``resume`` and ``abort`` may do to a rollout in each state, and the
refusal in the operator's words when it may not (the store's "illegal rollout transition PAUSED ->
PAUSED" is a check for programmers, not an answer for people).

Pure; the controller asks :func:`action_refusal` before it moves the stored state, and the broker
API answers ``wrong_state``, the console 409, with the text.
"""

from __future__ import annotations

from agent.errors import AgentError
from agent.fleet.rollout.records import ROLLOUT_MOVES, RolloutState

#: The state each operator action moves a rollout to.
ACTION_TARGET = {"pause": RolloutState.PAUSED, "resume": RolloutState.RUNNING, "abort": RolloutState.ABORTED}
_PAST = {"pause": "paused", "resume": "resumed", "abort": "aborted"}


class WrongStateError(AgentError):
    """The rollout's state does not allow this action; the text says why and what is possible."""

    code = "wrong_state"


def action_refusal(verb: str, rollout_id: str, state: RolloutState) -> str | None:
    """None when ``verb`` may move a rollout in ``state``; else one sentence for the operator."""
    target = ACTION_TARGET[verb]
    if ROLLOUT_MOVES.allows(state, target):
        return None
    if state is target:
        return f"rollout {rollout_id} is already {state.value}: nothing to do"
    if state in ROLLOUT_MOVES.terminal:
        return f"rollout {rollout_id} has ended ({state.value}): it cannot be {_PAST[verb]} any more"
    possible = [_PAST[v] for v, s in ACTION_TARGET.items() if ROLLOUT_MOVES.allows(state, s)]
    return f"rollout {rollout_id} is {state.value}: it cannot be {_PAST[verb]}, only {' or '.join(possible)}"
