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


def building_devices(rows: Sequence[DeviceRow], builds: Builds) -> tuple[list[dict[str, Any]], int]:
    """(the first :data:`MAX_BUILDING` devices of ``rows`` building the rollout's job, how many more),
    in wave order. Each entry: ``device``, ``wave`` (from 1), the progress fields (``phase``,
    ``frames_done``, ``frames_total``, ``elapsed_s``, ``estimate_s``; null when not sent) and ``note``,
    the text an operator reads (``calibrating 120/500 frames, 42 s of ~310 s``)."""
    found: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: (r.wave, r.device)):
        if row.step in (DeviceStep.ENDED, DeviceStep.CANCELLED):
            continue
        build = builds.get((row.device, row.job_id))
        if build is not None:
            found.append(
                {
                    "device": row.device,
                    "wave": row.wave + 1,
                    **build.model_dump(mode="json"),
                    "note": build_note(build),
                }
            )
    return found[:MAX_BUILDING], max(0, len(found) - MAX_BUILDING)
