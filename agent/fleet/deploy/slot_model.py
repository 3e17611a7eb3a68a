"""The model id a deploy keeps when ``--model-id`` is not given: the slot's current one.

A redeploy of ``shapes_classifier.onnx`` to a slot serving ``shapes-classifier`` (the config's id)
must not rename the model after the file's stem: a model's id is what dashboards, results and the
console key on. So the default is the id the target devices' retained ``up/info`` report for the
slot, when they agree; the file's stem only when the slot is empty everywhere (a first deploy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.errors import UsageError
from agent.fleet.base.untrusted import shown
from agent.fleet.view.status import DeviceRow


def slot_model_ids(rows: Sequence[DeviceRow], devices: Sequence[str], slot: str) -> dict[str, str]:
    """``device -> model id`` the slot serves, for the ``devices`` whose retained up/info says so."""
    wanted = set(devices)
    found = {}
    for row in rows:
        if row.device in wanted:
            model_id = (row.slots.get(slot) or {}).get("model_id")
            if isinstance(model_id, str) and model_id:
                found[row.device] = model_id
    return found


def default_model_id(current: Mapping[str, str], stem: str, slot: str) -> tuple[str, str]:
    """(the model id to deploy as, a line saying where it came from); pure.

    UsageError when the targets' slot serves models of different ids: no default is right then.
    """
    ids = sorted(set(current.values()))
    if not ids:
        return stem, f"model id {shown(stem, 64)} (the file's stem; slot {slot} is empty on the targets)"
    if len(ids) > 1:
        named = ", ".join(f"{shown(i, 64)} ({sum(1 for v in current.values() if v == i)})" for i in ids[:5])
        raise UsageError(
            f"--model-id: slot {slot} serves models of different ids on the targets ({named}); "
            "give --model-id"
        )
    return ids[0], f"model id {shown(ids[0], 64)} (what slot {slot} serves now; --model-id sets another)"
