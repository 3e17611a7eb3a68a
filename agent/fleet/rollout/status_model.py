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


class BuildingDevice(StrictModel):
    """A device of the rollout building its engine now: the latest progress it sent (in memory at the
    controller, never stored), and ``note``, the text the CLI and the console show."""

    device: str
    wave: int = Field(description="Counted from 1.")
    phase: str = Field(description="planning, slimming, calibrating, building, timing placements, checking.")
    frames_done: int | None = Field(description="Calibration frames consumed (phase calibrating).")
    frames_total: int | None
    elapsed_s: float = Field(description="Seconds since the build began, as the device said.")
    estimate_s: float | None = Field(description="Expected seconds in all, from earlier builds.")
    note: str = Field(
        description="e.g. 'calibrating 120/500 frames, 42 s of ~310 s'; 'waiting for jet-01's build, 35 s'."
    )
    waiting_for: str | None = Field(
        None,
        description="The device whose build of this engine it waits for (a build claim); absent when none.",
    )
    waited_s: float | None = Field(
        None, description="Seconds it has waited for that build; absent when none."
    )


class FellBackDevice(StrictModel):
    """An ACTIVE device of the rollout that runs another precision than its build asked."""

    device: str
    wave: int = Field(description="Counted from 1.")
    running: str | None = Field(description="The precision it runs (fp32, fp16, int8).")
    reason: str = Field(description="Why, as the device said (the INT8 guard's refusal, the plan's change).")


class PrecisionSummary(StrictModel):
    """What the rollout's ACTIVE devices run against the precision its build asked for."""

    requested: str = Field(description="build.precision: fp32, fp16, int8 or best.")
    running: dict[str, int] = Field(description="ACTIVE devices per precision they run.")
    sources: dict[str, int] = Field(description="ACTIVE devices per engine source: built, downloaded, model.")
    fell_back: list[FellBackDevice] = Field(description="At most 50, in wave order.")
    fell_back_count: int
    fell_back_to: dict[str, int] = Field(description="The devices that fell back, per precision they run.")


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
    rollback_of: str | None = Field(description="The rollout this one takes back (`fleet rollout rollback`).")
    rolled_back_by: list[str] = Field(description="The rollouts that take this one back; [] when none.")
    problem_devices: list[ProblemDevice] = Field(description="At most 50, in wave order.")
    problem_devices_left_off: int
    building: list[BuildingDevice] = Field(description="At most 50, in wave order; [] when none builds.")
    building_left_off: int
    precision: PrecisionSummary | None = Field(
        description="What its ACTIVE devices run against build.precision; null when no build was asked."
    )
