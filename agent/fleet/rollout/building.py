"""The devices of a rollout whose engine builds now, with the build's phase, frames, elapsed and
estimate: what ``fleet rollout status`` (``building``) and the console's rollouts page show. Pure.

The progress itself is the controller's :meth:`~agent.fleet.view.live.FleetView.builds` (in memory:
the devices send it at most every 2 s while BUILDING, and it is dropped once the job moves on); the
text of each entry is :func:`~agent.fleet.view.build_note.build_note`'s, the one ``fleet deploy`` and
``fleet watch`` print.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.fleet.rollout.records import DeviceRow, DeviceStep
from agent.fleet.view.build_note import build_note
from agent.protocol.messages import BuildProgressInfo

#: Most building devices a status document names (a wave of 1,000 devices may build at once).
MAX_BUILDING = 50

#: ``(device, job_id)`` -> the latest progress of that job while it is BUILDING.
Builds = Mapping[tuple[str, str], BuildProgressInfo]
#: ``device`` -> (the device whose build it waits for, seconds waited): the controller's build claims.
Waits = Mapping[str, tuple[str, float]]


def building_devices(
    rows: Sequence[DeviceRow], builds: Builds, waits: Waits | None = None
) -> tuple[list[dict[str, Any]], int]:
    """(the first :data:`MAX_BUILDING` devices of ``rows`` building the rollout's job, how many more),
    in wave order. Each entry: ``device``, ``wave`` (from 1), the progress fields (``phase``,
    ``frames_done``, ``frames_total``, ``elapsed_s``, ``estimate_s``; null when not sent) and ``note``,
    the text an operator reads (``calibrating 120/500 frames, 42 s of ~310 s``). A device that has not
    begun building but waits for another device's build of its engine (``waits``) has ``waiting_for``
    and ``waited_s`` too, and its note says so (``waiting for jet-01's build, 35 s``)."""
    found: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: (r.wave, r.device)):
        if row.step in (DeviceStep.ENDED, DeviceStep.CANCELLED):
            continue
        build = builds.get((row.device, row.job_id))
        if build is not None:
            entry = {"device": row.device, "wave": row.wave + 1, **build.model_dump(mode="json")}
            wait = (waits or {}).get(row.device)
            if wait is not None and build.phase == "planning":  # asked the fleet, not building yet
                builder, waited_s = wait
                entry.update(
                    waiting_for=builder,
                    waited_s=waited_s,
                    note=f"waiting for {builder}'s build, {waited_s:.0f} s",
                )
            else:
                entry["note"] = build_note(build)
            found.append(entry)
    return found[:MAX_BUILDING], max(0, len(found) - MAX_BUILDING)
