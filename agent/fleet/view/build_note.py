"""One short text for a running engine build, as the operator's commands show it.

``calibrating 120/500 frames, 42 s of ~310 s``: the phase, calibration frames when counted, seconds
elapsed and the device's estimate from earlier builds of the same fingerprint. Pure; the phase is
one of the protocol's fixed names, so nothing the device chose reaches the terminal but numbers.
"""

from __future__ import annotations

from agent.protocol.messages import BuildProgressInfo


def build_note(build: BuildProgressInfo | None) -> str:
    """The build's text, or "" when there is none."""
    if build is None:
        return ""
    text: str = build.phase
    if build.frames_total is not None:
        text += f" {build.frames_done or 0}/{build.frames_total} frames"
    text += f", {build.elapsed_s:.0f} s"
    if build.estimate_s is not None:
        text += f" of ~{build.estimate_s:.0f} s"
    return text
