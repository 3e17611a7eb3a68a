"""Rolling back a finished rollout: new rollouts, in waves with the gate, that take each device the
finished one moved back to the model it served before (``fleet rollout rollback ID``).

Which devices: those whose job of the finished rollout ended ``ACTIVE`` (the others run their
previous model already). They are grouped by the model each served before (the store's
``from_version``, read from the device's ``up/info`` when the finished rollout was created); each
group becomes one rollout of that model, made from the request of the rollout of this store that
deployed it, with the waves, soak and gate asked for (by default the finished rollout's own). Its
manifests are ways back (``rollback: true``, no shadow, no probation): the device records the model
it leaves as rolled back from, so its own ``rollback`` never returns to it.

Pure but for reading the store: the controller stores the rollouts (one store transaction each) and
notes them on the finished rollout, so a second rollback of it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.fleet.rollout.actions import WrongStateError
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceStep, RolloutState
from agent.fleet.rollout.rollback import deployed_requests
from agent.fleet.rollout.spec import ROLLOUT_ID, RolloutRequest, ref_sha256, request_of
from agent.fleet.rollout.store import RolloutNotFoundError, RolloutStore

#: The event on the finished rollout naming the rollouts that roll it back.
ROLLED_BACK_BY = "rolled_back_by"
#: What the operator may set for the rollback's waves and gate (default: the finished rollout's).
WAVE_FIELDS = ("waves", "soak_s", "max_failed", "wave_timeout_s", "on_timeout")


@dataclass
class FinishedRollback:
    """The rollouts that take a finished rollout's devices back, and the devices none can take."""

    rollout_id: str
    requests: list[RolloutRequest] = field(default_factory=list)
    #: Devices whose slot was empty before the rollout: nothing to go back to.
    no_previous: list[str] = field(default_factory=list)
    #: Devices whose previous model no rollout of this controller deployed (their own ``rollback``
    #: command puts back their last-known-good model).
    unknown_previous: list[str] = field(default_factory=list)

    def note(self) -> dict[str, Any]:
        """What the finished rollout's ``rolled_back_by`` event keeps."""
        return {
            "rollouts": [r.rollout_id for r in self.requests],
            "no_previous": self.no_previous,
            "unknown_previous": self.unknown_previous,
        }


def plan_finished_rollback(
    store: RolloutStore, rollout_id: str, options: Mapping[str, Any], new_id: str | None = None
) -> FinishedRollback:
    """The rollouts that roll back the finished rollout ``rollout_id`` (see the module docstring).

    ``options``: any of :data:`WAVE_FIELDS`; ``new_id``: the rollback's id (default ``ID-rollback``,
    with the previous model's SHA-256 prefix when the devices ran several). WrongStateError when the
    rollout has not finished, was rolled back already, or has no device to move back.
    """
    row = store.rollout(rollout_id)
    if row.state is not RolloutState.DONE:
        raise WrongStateError(
            f"rollout {rollout_id} is {row.state.value}: only a finished (DONE) rollout is rolled back "
            f"this way; `fleet rollout abort {rollout_id} --rollback` moves a running one's devices back"
        )
    for what, detail in store.events(rollout_id):
        if what == ROLLED_BACK_BY:
            raise WrongStateError(
                f"rollout {rollout_id} was rolled back already, by {', '.join(detail['rollouts']) or 'none'}"
            )
    unknown = sorted(set(options) - set(WAVE_FIELDS))
    if unknown:
        raise ValueError(f"rollback: unknown option(s) {', '.join(unknown)}; known: {', '.join(WAVE_FIELDS)}")
    finished = request_of(row.spec)
    known = deployed_requests(store, row.slot)
    plan = FinishedRollback(rollout_id)
    groups: dict[str, list[str]] = {}
    for device in store.devices(rollout_id):  # in the finished rollout's order: its canaries first
        if device.step is not DeviceStep.ENDED or device.end is not DeviceEnd.ACTIVE:
            continue
        sha = ref_sha256(device.from_version)
        if sha is None:
            plan.no_previous.append(device.device)
        elif sha == finished.model_sha256:
            continue  # it ran this very model before: it is where it was
        elif sha not in known:
            plan.unknown_previous.append(device.device)
        else:
            groups.setdefault(sha, []).append(device.device)
    if not groups:
        raise WrongStateError(f"rollout {rollout_id} has no device to move back: {_nobody(plan)}")
    base_id = new_id or f"{rollout_id}-rollback"
    for sha, devices in groups.items():
        ident = base_id if len(groups) == 1 else f"{base_id}-{sha[:8]}"
        if not ROLLOUT_ID.match(ident):
            raise ValueError(f"rollback: {ident!r} is not a rollout id (pattern {ROLLOUT_ID.pattern})")
        if _exists(store, ident):  # checked for all before any is stored: none or every one starts
            raise WrongStateError(f"rollout {ident} exists already; name the rollback otherwise (--id)")
        fields = {name: options.get(name, getattr(finished, name)) for name in WAVE_FIELDS}
        previous = known[sha].model_dump(mode="json")
        previous.update(
            fields,
            rollout_id=ident,
            devices=devices,
            rollback_on_abort=False,
            supersedes=None,
            shadow=None,
            probation_s=None,
            probation=None,
            rollback_of=rollout_id,
        )
        plan.requests.append(RolloutRequest.model_validate(previous))
    return plan


def _exists(store: RolloutStore, rollout_id: str) -> bool:
    try:
        store.rollout(rollout_id)
    except RolloutNotFoundError:
        return False
    return True


def _nobody(plan: FinishedRollback) -> str:
    parts = []
    if plan.no_previous:
        parts.append(f"{', '.join(plan.no_previous)} had no model in the slot before")
    if plan.unknown_previous:
        parts.append(
            f"{', '.join(plan.unknown_previous)} ran a model no rollout of this controller deployed "
            "(`fleet cmd DEVICE rollback` puts back a device's last-known-good model)"
        )
    return "; ".join(parts) or "none of its devices ended ACTIVE"
