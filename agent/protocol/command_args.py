"""The arguments of each device command (``CommandRequest.args``), one model per command.

The command router validates a request's ``args`` against the command's model before the handler
runs, so a wrong argument is answered ``bad_args`` naming it, never a Python error from deep inside
the handler. Unknown arguments are refused too: a typo (``"frame": 50``) must not be silently ignored.
"""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel


class NoArgs(StrictModel):
    """A command without arguments (``status``)."""


class SlotArgs(StrictModel):
    """A command on one model slot (``rollback``)."""

    slot: str = Field(min_length=1, description="The model slot, as named in the device's `slots:`.")


class CalibrateArgs(SlotArgs):
    """``calibrate``: INT8-calibrate the slot's model on live frames of its streams."""

    # strict: "200" or 200.5 is a client bug to report, not a number to guess at.
    frames: int = Field(200, ge=1, le=100_000, strict=True, description="Live frames to calibrate on.")


class SnapshotArgs(StrictModel):
    """``snapshot``: the latest frame of a stream, as a JPEG."""

    stream: str | None = Field(
        None, min_length=1, description="The stream; default: the first stream of the device's config."
    )
    # strict: "640" is a client bug to report, not a number to guess at.
    max_dimension: int | None = Field(
        None, ge=16, le=8192, strict=True, description="Longest side wanted (capped by the device's)."
    )


class LogsArgs(StrictModel):
    """``logs``: the agent's latest log lines, or those after a sequence number (``--follow``)."""

    lines: int = Field(100, ge=1, le=1000, strict=True, description="Most lines returned.")
    after: int | None = Field(
        None, ge=0, strict=True, description="Only lines numbered above this (the last `seq` seen)."
    )


class EvidenceArgs(StrictModel):
    """``evidence``: the frames a rejected job's candidate disagreed on (an index, or one frame)."""

    job_id: str = Field(min_length=1, max_length=128, description="The rejected deployment job.")
    frame: int | None = Field(
        None, ge=0, strict=True, description="One frame of the index (with its JPEG); none: the index."
    )
