"""Each camera of a device as the operator sees it: its source's state and last failure from
``up/info``, its live figures (fps, age of the last frame) from the latest ``up/telemetry``.

Pure functions over what a device sent, bounded here: at most :data:`MAX_CAMERAS` cameras per
device (the first by name), their text cut by the callers' own limits (``fleet status``'s
:func:`~agent.fleet.view.status.clip_strings`, the fleet view's ``fit``) and printed through
:func:`~agent.fleet.base.untrusted.shown`. ``fleet status``, the console's device page and the
controller's records all read a camera through :func:`camera_rows`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.protocol.messages import InfoMessage

#: Cameras kept per device (an AGX Orin decodes up to about 30 1080p streams; a device may claim
#: thousands). 32 with their errors fit in the fleet view's INFO_BYTES beside the slots.
MAX_CAMERAS = 32
#: The telemetry figures of one camera, by the name each has in a camera row.
_FIGURES = {
    "fps": "fps",
    "capture_fps": "capture_fps",
    "last_frame_age_s": "source.last_frame_age_s",
}


def camera_summary(info: InfoMessage) -> dict[str, dict[str, Any]]:
    """The first :data:`MAX_CAMERAS` cameras of ``info`` by name, as plain dicts."""
    names = sorted(info.cameras)[:MAX_CAMERAS]
    return {name: info.cameras[name].model_dump(mode="json") for name in names}


def camera_rows(
    cameras: Mapping[str, Mapping[str, Any]], telemetry: Mapping[str, float]
) -> list[dict[str, Any]]:
    """One row per camera, by name: ``up/info``'s fields, then its latest figures (None when the
    telemetry did not carry one: a device that has not sent any yet, or an older agent)."""
    rows = []
    for name in sorted(cameras)[:MAX_CAMERAS]:
        camera = cameras[name]
        row: dict[str, Any] = {"stream": name, **camera}
        for field, figure in _FIGURES.items():
            row[field] = telemetry.get(f"stream.{name}.{figure}")
        rows.append(row)
    return rows


def camera_down(row: Mapping[str, Any]) -> bool:
    """True for a camera that is not delivering frames: any state but ``streaming`` and ``ended``
    (a file played to its end on purpose)."""
    return row.get("state") not in {"streaming", "ended"}
