"""The ``rollback`` command: a slot goes back to its last-known-good model, one step, never forward.

During a probation the last-known-good model is still loaded, and the probation ends at once;
otherwise the model recorded in state.json as last-known-good is activated again (and recorded,
or nothing changes).

The way back runs on a thread of its own: one that is not over within :data:`REPLY_WITHIN_S` (an
engine rebuilt, a swap in flight to wait for) is answered ``state: running`` at once and its end
follows as the command's final reply, so an operator's ``--timeout`` never reads a rollback under
way as no reply. A second ``rollback`` of the slot meanwhile follows the same one.

One job (the way back), through the slot's owner (:class:`~agent.runtime.slots.models.owner.SlotOwner`)
and its lock.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog

from agent.delivery.commands import Followed
from agent.errors import AgentError, DiskFullError
from agent.runtime.slots.guarded import GuardRun
from agent.runtime.slots.models.owner import SlotOwner
from agent.runtime.slots.models.sources import build_of, from_record, model_source
from agent.runtime.slots.probation import ProbationRun
from agent.state.file import ModelRecord

log = structlog.get_logger(__name__)

#: How long a ``rollback`` during probation waits for the swap back and the rejected model's last result.
ROLLBACK_WAIT_S = 15.0
#: How long the ``rollback`` command waits for the way back before it answers ``state: running``
#: (well within the operator's default 10 s ``--timeout``).
REPLY_WITHIN_S = 5.0


class NoRollbackTargetError(AgentError):
    """``rollback`` on a slot with no older model to go back to (never had one, or already rolled back)."""

    code = "no_rollback_target"


class SlotRollback:
    """Rolls a slot back: the probation's swap back, or the last-known-good model of state.json."""

    def __init__(
        self, owner: SlotOwner, guard_runs: dict[str, GuardRun], *, reply_within_s: float = REPLY_WITHIN_S
    ) -> None:
        self._owner = owner
        #: The shadow or probation running (or last run) per slot, as deployments publish them.
        self._guard_runs = guard_runs
        self._reply_within_s = reply_within_s
        self._lock = threading.Lock()
        #: Per slot, the way back under way (or last run) and what its ``running`` answer says.
        self._running: dict[str, tuple[Future[dict[str, Any]], dict[str, Any]]] = {}

    def rollback(self, slot: str) -> dict[str, Any] | Followed:
        """``rollback`` command: make the slot's last-known-good model active again; its result, or
        :class:`Followed` when it is not over within the reply window (the final reply follows).

        During a probation the last-known-good model is still loaded: the probation ends at once,
        swapping back to it (the job ends ROLLED_BACK operator_rollback)."""
        self._owner.check_slot(slot)
        with self._lock:
            running = self._running.get(slot)
            if running is None or running[0].done():
                target = self._owner.state.slot(slot).last_known_good
                interim: dict[str, Any] = {
                    "slot": slot,
                    "since": time.time(),
                    "to": None
                    if target is None
                    else {"model_id": target.model_id, "version": target.version},
                }
                running = (Future(), interim)
                self._running[slot] = running
                threading.Thread(
                    target=self._run, args=(slot, running[0]), name=f"rollback-{slot}", daemon=True
                ).start()
        done, interim = running
        try:
            return done.result(timeout=self._reply_within_s)
        except TimeoutError:
            log.info("slot.rollback.running", slot=slot, reply_within_s=self._reply_within_s)
            return Followed(interim, done)

    def _run(self, slot: str, done: Future[dict[str, Any]]) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(self._roll_back(slot))
        except BaseException as exc:  # noqa: BLE001 (the command's final reply carries it)
            done.set_exception(exc)

    def _roll_back(self, slot: str) -> dict[str, Any]:
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
