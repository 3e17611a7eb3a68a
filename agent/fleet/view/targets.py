"""Each device's own targets as it reports them in ``up/info``: the configuration overlay it runs and
the agent release, what is being applied or watched (pending), and why the last one tried was put back.

What a device says here is bounded twice before it is kept: by the message model (each field has a
length cap) and by :func:`~agent.fleet.base.bounded.fit` (:data:`TARGETS_BYTES`); it passes through
:func:`~agent.fleet.base.untrusted.shown` before it is printed.
"""

from __future__ import annotations

from typing import Any

from agent.fleet.base.bounded import fit
from agent.fleet.base.untrusted import shown
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import InfoMessage

#: The targets a device reports, by the name ``fleet status --json`` and the console use.
TARGET_NAMES = ("config", "agent")
#: Estimated bytes kept of one device's targets (two TargetInfo at their longest fit well within).
TARGETS_BYTES = 4096
#: Longest text kept of one field (TargetInfo's longest, ``reverted``, is 300 characters).
TARGET_TEXT = 300


def target_summary(info: InfoMessage) -> dict[str, dict[str, Any]]:
    """``{"config": {...}, "agent": {...}}`` for the targets ``info`` reports (a device that does not
    report one, an older agent, leaves it out)."""
    reported: dict[str, TargetInfo | None] = {"config": info.config, "agent": info.agent_release}
    summary = {name: t.model_dump(mode="json") for name, t in reported.items() if t is not None}
    kept, _cut = fit(summary, TARGETS_BYTES, TARGET_TEXT)
    return dict(kept)


def target_cell(name: str, target: dict[str, Any] | None) -> str:
    """``v3``, ``v3 -> v4`` while v4 is applied or watched, ``-`` when none; ``(reverted)`` when the
    last version tried was put back (a note line says why)."""
    if not target:
        return "-"
    # No overlay: the device runs its own agent.yaml as installed.
    cell = shown(target.get("version") or ("base" if name == "config" else "-"), 24)
    if target.get("pending"):
        cell += f" -> {shown(target['pending'], 24)}"
    if target.get("reverted"):
        cell += " (reverted)"
    return cell


def target_notes(targets: dict[str, dict[str, Any]]) -> list[str]:
    """One line per target whose last version was put back: which, and the device's reason."""
    return [
        f"{name} put back: {shown(t['reverted'], 300)}"
        for name, t in sorted(targets.items())
        if t.get("reverted")
    ]
