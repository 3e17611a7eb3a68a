"""The shape of the controller's RolloutStatus (the ``result`` of ``start``, ``status``, ``pause``,
``resume``, ``abort`` and each entry of ``list``; docs/protocol.md "RolloutStatus").

:func:`agent.fleet.rollout.report.rollout_status` builds the document as a plain dict; this model only
describes it, for ``edge-agent schema`` (consumers in other languages) and for the test that checks
every real status validates against it (unknown keys are refused, so the two cannot drift apart).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from agent.model_base import StrictModel


class RolloutPolicy(StrictModel):
    """How the rollout was asked to go (from its stored request)."""

    waves: str | None
    max_failed: str | None
    soak_s: float | None
    wave_timeout_s: float | None
    on_timeout: str | None
    rollback_on_abort: bool | None


class WaveStatus(StrictModel):
    """One wave: its state, device counts and the gate's figures when it ended."""

    index: int = Field(description="The wave counted from 0 (kept for older readers).")
    wave: int = Field(description="The wave counted from 1, as the CLI, the console and /metrics do.")
    state: str
    devices: int
    ends: dict[str, int] = Field(description="Devices by where they stand: PLANNED, PENDING, a job's end ...")
    reason: str
    started_at: float | None
    ended_at: float | None
    figures: dict[str, Any] | None = Field(description="The gate's counts when the wave ended; null before.")


class SendCounts(StrictModel):
    devices: int
    resent: int = Field(description="Devices whose desired state was published again (controller restart).")


class RollbackStatus(StrictModel):
    by_desired_state: int
    by_command: int
    no_previous: list[str]
    ends: dict[str, int] | None


class ProblemDevice(StrictModel):
    """A device the gate counts against max_failed, with its code and the figure that failed."""

    device: str
    wave: int = Field(description="Counted from 1.")
    end: str = Field(description="FAILED, REJECTED, ROLLED_BACK, TIMED_OUT or UNHEALTHY.")
    error_code: str | None
    figure: str | None


class RolloutStatus(StrictModel):
    """A rollout as ``fleet rollout status --json`` prints it."""

    rollout_id: str
    state: str
    reason: str
    slot: str
    model: str
    version: str
    job_id: str
    created_at: float
    updated_at: float
    policy: RolloutPolicy
    waves: list[WaveStatus]
    devices: dict[str, int]
    sends: SendCounts
    rollback: RollbackStatus | None
    problem_devices: list[ProblemDevice] = Field(description="At most 50, in wave order.")
    problem_devices_left_off: int
