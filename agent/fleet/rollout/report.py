"""A rollout as an operator reads it: the ``status --json`` document and its lines of text. Pure
but for reading the store.

``fleet rollout status --json`` prints :func:`rollout_status` as it is; docs/fleet.md shows one,
checked by a test against a real rollout.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.fleet.base.untrusted import shown
from agent.fleet.rollout.building import Builds, Waits, building_devices
from agent.fleet.rollout.gate import GatePolicy
from agent.fleet.rollout.precision import precision_lines, precision_summary, requested_precision
from agent.fleet.rollout.problems import MAX_LISTED, device_problems
from agent.fleet.rollout.records import DeviceStep
from agent.fleet.rollout.spec import request_of
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.rollout.waves import format_duration


def rollout_status(
    store: RolloutStore, rollout_id: str, builds: Builds | None = None, waits: Waits | None = None
) -> dict[str, Any]:
    """Everything ``status`` shows of one rollout: its state, each wave with counts and times, the
    rollback, and the devices building now, from ``builds`` (the controller's :meth:`FleetView.builds`;
    none given: none listed), each waiting for whose build where ``waits`` (the build claims) says."""
    row = store.rollout(rollout_id)
    devices = store.devices(rollout_id)
    request = row.spec.get("request", {})
    waves = []
    for wave in store.wave_rows(rollout_id):
        members = [d for d in devices if d.wave == wave.index]
        ends = Counter(_where(d.step, d.end.value if d.end else None) for d in members)
        waves.append(
            {
                "index": wave.index,
                "wave": wave.index + 1,  # as operators count them; index (0-based) stays for old readers
                "state": wave.state.value,
                "devices": len(members),
                "ends": dict(sorted(ends.items())),
                "reason": wave.reason,
                "started_at": wave.started_at,
                "ended_at": wave.ended_at,
                "figures": wave.figures,
            }
        )
    problems, left_off = device_problems(devices, _policy(row.spec))
    building, building_left_off = building_devices(devices, builds or {}, waits)
    return {
        "rollout_id": row.rollout_id,
        "state": row.state.value,
        "reason": row.reason,
        "slot": row.slot,
        "model": request.get("model_id") or Path(str(request.get("model_name", "?"))).stem,
        "version": row.to_version,
        "job_id": row.job_id,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
        "policy": rollout_policy(row.spec),
        "waves": waves,
        "devices": dict(
            sorted(Counter(_where(d.step, d.end.value if d.end else None) for d in devices).items())
        ),
        "sends": {"devices": len(devices), "resent": sum(1 for d in devices if d.sends > 1)},
        "rollback": rollback_outcome(store, rollout_id),
        "rollback_of": request.get("rollback_of"),
        "rolled_back_by": rolled_back_by(store, rollout_id),
        "problem_devices": problems,
        "problem_devices_left_off": left_off,
        "building": building,
        "building_left_off": building_left_off,
        "precision": precision_summary(devices, requested_precision(request)),
    }


def rolled_back_by(store: RolloutStore, rollout_id: str) -> list[str]:
    """The rollouts that roll back the finished rollout ``rollout_id`` (``fleet rollout rollback``)."""
    return [
        str(r)
        for what, detail in store.events(rollout_id)
        if what == "rolled_back_by"
        for r in detail["rollouts"]
    ]


def rollback_outcome(store: RolloutStore, rollout_id: str) -> dict[str, Any] | None:
    """What the rollback of an aborted rollout did (None: no rollback was asked for), from its events:
    ``by_desired_state``/``by_command`` device counts, ``no_previous`` device ids, the devices'
    ``ends`` by state once it finished (None while it runs). ``status`` and the console show it."""
    rollback: dict[str, Any] | None = None
    for what, detail in store.events(rollout_id):
        if what in ("rollback", "rollback_by_command", "rollback_none", "rollback_done"):
            rollback = rollback or {"by_desired_state": 0, "by_command": 0, "no_previous": [], "ends": None}
            if what == "rollback":
                rollback["by_desired_state"] += len(detail.get("devices", ()))
            elif what == "rollback_by_command":
                rollback["by_command"] += len(detail.get("devices", ()))
            elif what == "rollback_none":
                rollback["no_previous"] = list(detail.get("devices", ()))
            else:
                rollback["ends"] = dict(sorted(Counter(detail.get("ends", {}).values()).items()))
    return rollback


def _policy(spec: Mapping[str, Any]) -> GatePolicy | None:
    """The gate the rollout was stored with; None for a spec this version cannot read."""
    try:
        return request_of(spec).policy()
    except (KeyError, ValueError, AgentError):  # pydantic's ValidationError is a ValueError
        return None


def rollout_policy(spec: Mapping[str, Any]) -> dict[str, Any]:
    """How a stored rollout was asked to go (waves, gate, timeouts), from its ``spec``'s request:
    what ``status --json`` and the console show, without the device list and the manifest."""
    request = spec.get("request", {})
    keys = ("waves", "max_failed", "soak_s", "wave_timeout_s", "on_timeout", "rollback_on_abort")
    return {key: request.get(key) for key in keys}


def _where(step: DeviceStep, end: str | None) -> str:
    """One word for where a device stands: its end once ENDED, its job's state while it works."""
    if step is DeviceStep.ENDED and end:
        return end
    if step in (DeviceStep.SENT, DeviceStep.SENDING):
        return "PENDING" if end in (None, "PENDING") else end
    return str(step.value)  # PLANNED, CANCELLED


def soak_note(figures: Mapping[str, Any] | None, now: float) -> str:
    """``soak: 4 min 10 s left (until 12:34:56 UTC)`` for a soaking wave's figures (``soak_until``, a
    Unix time), or "": an operator wants to know how much is left, not how long it was."""
    until = (figures or {}).get("soak_until")
    if not isinstance(until, (int, float)) or isinstance(until, bool):
        return ""
    clock = time.strftime("%H:%M:%S UTC", time.gmtime(until))
    if until <= now:
        return f"soak over at {clock}; the next wave starts"
    return f"soak: {format_duration(until - now)} left (until {clock})"


def status_lines(status: dict[str, Any], now: float | None = None) -> list[str]:
    """``fleet rollout status`` as text: a header, a line per wave, the rollback. ``now`` (Unix time,
    default the clock's) is what a soak's time left is counted from."""
    now = time.time() if now is None else now
    policy = status["policy"]
    lines = [
        f"rollout {status['rollout_id']}: {status['state']}  slot {status['slot']}  "
        f"{status['model']} {status['version']}  waves {policy['waves']}  max-failed {policy['max_failed']}"
        + (f"  soak {policy['soak_s']:g}s" if policy.get("soak_s") else ""),
    ]
    if status["reason"]:
        lines.append(f"  {status['reason']}")
    if status.get("rollback_of"):
        lines.append(
            f"  rolls back rollout {status['rollback_of']}: each device to the model it served before"
        )
    if status.get("rolled_back_by"):
        lines.append(f"  rolled back by {', '.join(status['rolled_back_by'])}")
    for wave in status["waves"]:
        counts = ", ".join(f"{k} {v}" for k, v in wave["ends"].items())
        lines.append(
            f"  wave {wave['index'] + 1}: {wave['state']:<9} {wave['devices']:>5} device(s)  {counts}"
            + wave_times(wave)
        )
        if wave["reason"] and wave["state"] not in ("WAITING",):
            lines.append(f"          {wave['reason']}")
        if wave["state"] == "SOAKING" and (note := soak_note(wave.get("figures"), now)):
            lines.append(f"          {note}")
    lines += building_lines(status)
    lines += precision_lines(status.get("precision"))
    lines += problem_lines(status)
    rollback = status.get("rollback")
    if rollback:
        ends = rollback.get("ends")
        line = (
            f"  rollback: {rollback['by_desired_state']} device(s) sent their previous model, "
            f"{rollback['by_command']} told to roll back"
        )
        if ends:
            line += " (" + ", ".join(f"{k} {v}" for k, v in sorted(ends.items())) + ")"
        if rollback["no_previous"]:
            line += f"; {len(rollback['no_previous'])} had no previous model"
        lines.append(line)
    return lines


def wave_times(wave: Mapping[str, Any]) -> str:
    """``  09:16:23-09:26:30 UTC (10 min 07 s)`` for an ended wave, ``  since 09:26:30 UTC`` for one
    running (no seconds counting up: ``--watch`` prints again only when something changed), ""
    for one not started."""
    started, ended = wave.get("started_at"), wave.get("ended_at")
    if not isinstance(started, (int, float)):
        return ""
    start = time.strftime("%H:%M:%S", time.gmtime(started))
    if not isinstance(ended, (int, float)):
        return f"  since {start} UTC"
    end = time.strftime("%H:%M:%S", time.gmtime(ended))
    return f"  {start}-{end} UTC ({format_duration(ended - started)})"


#: Building devices ``status`` prints as text (``--json`` carries up to MAX_BUILDING).
_BUILDING_LINES = 20


def building_lines(status: dict[str, Any]) -> list[str]:
    """A line per device building its engine now: its wave and the build's note (phase, frames,
    elapsed, estimate; :func:`~agent.fleet.view.build_note.build_note`'s text)."""
    building = status.get("building") or []
    if not building:
        return []
    total = len(building) + int(status.get("building_left_off") or 0)
    lines = [f"  {total} device(s) building their engine:"]
    lines += [
        f"    {shown(entry['device'], 64)}  wave {entry['wave']}  {shown(entry['note'], 120)}"
        for entry in building[:_BUILDING_LINES]
    ]
    if total > _BUILDING_LINES:
        lines.append(f"    ... and {total - _BUILDING_LINES} more")
    return lines


#: Problem devices ``status`` prints as text (``--json`` carries up to MAX_LISTED).
_PROBLEM_LINES = 20


def problem_lines(status: dict[str, Any]) -> list[str]:
    """A line per device that failed, rolled back, timed out or is unhealthy: code and figure."""
    problems = status.get("problem_devices") or []
    if not problems:
        return []
    total = len(problems) + int(status.get("problem_devices_left_off") or 0)
    lines = [f"  {total} device(s) failed, rolled back, timed out or unhealthy:"]
    for problem in problems[:_PROBLEM_LINES]:
        why = "  ".join(str(problem[k]) for k in ("error_code", "figure") if problem.get(k))
        lines.append(
            f"    {shown(problem['device'], 64)}  wave {problem['wave']}  {problem['end']}"
            + (f"  {why}" if why else "")
        )
    if total > _PROBLEM_LINES:
        lines.append(f"    ... and {total - _PROBLEM_LINES} more (`--json` lists up to {MAX_LISTED})")
    return lines


def list_line(status: dict[str, Any]) -> str:
    """One line of ``fleet rollout list``."""
    states = [w["state"] for w in status["waves"]]
    # A tripped or cancelled wave is no wave done: an aborted rollout must not read as finished.
    ended = "".join(f", {states.count(s)} {s.lower()}" for s in ("TRIPPED", "CANCELLED") if s in states)
    devices = sum(status["devices"].values())
    return (
        f"{status['rollout_id']:<44} {status['state']:<10} {status['slot']:<12} "
        f"{status['model']} {status['version']}  {states.count('DONE')} of {len(states)} waves done"
        f"{ended}  {devices} device(s)"
    )
