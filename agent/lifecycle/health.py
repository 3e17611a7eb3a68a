"""Whether the device is healthy after a change of its own (a configuration overlay, an agent release).

One rule for both, pure: connected to the broker if it was before the change, frames flowing on every
stream that flowed before the change, and no slot failing that served before it. A stream or slot the
change itself added or removed is not held against it (a configuration may remove a camera on purpose);
one it kept is. A device that was offline before (a bundle imported at a site with no network) is not
asked to connect: nothing it could reach before is missing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthReading:
    """What the running agent reports of itself at one moment (the composition root reads it)."""

    connected: bool
    #: Streams whose frames advanced since the previous reading.
    streams_flowing: frozenset[str]
    #: Every configured stream, flowing or not.
    streams: frozenset[str]
    #: Slots with no model serving because a load or activation failed.
    slots_failing: frozenset[str]


def unhealthy_because(before: HealthReading, now: HealthReading) -> str | None:
    """Why the device is not healthy now compared with ``before`` (the reading taken before the change);
    None when it is."""
    if before.connected and not now.connected:
        return "not connected to the broker"
    stalled = sorted((before.streams_flowing & now.streams) - now.streams_flowing)
    if stalled:
        return f"no frames on stream(s) {', '.join(stalled)}, which flowed before the change"
    failing = sorted(now.slots_failing - before.slots_failing)
    if failing:
        return f"slot(s) {', '.join(failing)} failing"
    return None
