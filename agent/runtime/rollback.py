"""The ``rollback`` command: a slot goes back to its last-known-good model, one step, never forward.

During a probation the last-known-good model is still loaded, and the probation ends at once;
otherwise the model recorded in state.json as last-known-good is activated again (and recorded,
or nothing changes).

One job (the way back), through the slot's owner (:class:`~agent.runtime.slot_owner.SlotOwner`)
and its lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from agent.errors import AgentError, DiskFullError
from agent.runtime.guarded import GuardRun
from agent.runtime.model_sources import build_of, from_record, model_source
from agent.runtime.probation import ProbationRun
from agent.runtime.slot_owner import SlotOwner
from agent.state import ModelRecord

log = structlog.get_logger(__name__)

#: How long a ``rollback`` during probation waits for the swap back and the rejected model's last result.
ROLLBACK_WAIT_S = 15.0


class NoRollbackTargetError(AgentError):
    """``rollback`` on a slot with no older model to go back to (never had one, or already rolled back)."""

    code = "no_rollback_target"


class SlotRollback:
    """Rolls a slot back: the probation's swap back, or the last-known-good model of state.json."""

    def __init__(self, owner: SlotOwner, guard_runs: dict[str, GuardRun]) -> None:
        self._owner = owner
        #: The shadow or probation running (or last run) per slot, as deployments publish them.
        self._guard_runs = guard_runs

    def rollback(self, slot: str) -> dict[str, Any]:
        """``rollback`` command: make the slot's last-known-good model active again.

        During a probation the last-known-good model is still loaded: the probation ends at once,
        swapping back to it (the job ends ROLLED_BACK operator_rollback)."""
        self._owner.check_slot(slot)
        run = self._guard_runs.get(slot)
        if isinstance(run, ProbationRun) and run.end_by_operator(ROLLBACK_WAIT_S):
            current = self._owner.slots[slot].current
            log.warning("slot.rolled_back", slot=slot, during="probation")
            return {
                "slot": slot,
                "model": current.ref.model_dump() if current else None,
                "probation": "ended",
            }
        self._owner.wait_initial_load(slot)
        # Under the slot's lock: a swap in flight (a config reload serves first, records after)
        # has recorded its model before the rollback reads which model came before it.
        with self._owner.lock(slot):
            return self._rollback(slot)

    def _rollback(self, slot: str) -> dict[str, Any]:
        owner = self._owner
        saved = owner.state.slot(slot)
        record = saved.last_known_good
        if record is None:
            raise NoRollbackTargetError(_why_no_rollback_target(slot, saved.active))
        if not Path(record.path).exists():
            raise NoRollbackTargetError(
                f"slot {slot!r} cannot roll back to {_named(record)}: its file {record.path} is gone"
            )
        current = owner.slots[slot].current
        base = current.source if current is not None else model_source(owner.slot_configs[slot])
        source = owner.prepared(slot, from_record(base, record), build_of(record))
        try:
            loaded = owner.activate_locked(slot, source, "rollback", must_record=True)
        except OSError as exc:
            ref = current.ref if current is not None else None
            serving = (
                f"{ref.model_id} {ref.version or '(no version)'} keeps serving" if ref else "nothing changed"
            )
            raise DiskFullError(
                f"slot {slot!r} cannot roll back to {_named(record)}: state.json cannot be written "
                f"({exc}), and a rollback a restart would undo is no rollback; {serving}. Free space "
                "on the state disk and send it again"
            ) from exc
        log.warning("slot.rolled_back", slot=slot, model=record.model_id, version=record.version)
        return {"slot": slot, "model": loaded.ref.model_dump()}


def _named(record: ModelRecord) -> str:
    return f"{record.model_id} {record.version or '(no version)'}"


def _why_no_rollback_target(slot: str, active: ModelRecord | None) -> str:
    if active is not None and active.origin == "rollback":
        return (
            f"slot {slot!r} was already rolled back to {_named(active)}; a rollback goes back one step, "
            "never forward: deploy a model (or change the config's) to move on"
        )
    return f"slot {slot!r} has no last-known-good model to roll back to (no earlier model ran in it)"
