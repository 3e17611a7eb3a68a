"""What the rollout store keeps: the states of rollouts, waves and devices, their legal moves, and
the rows read back (:mod:`agent.fleet.rollout.store` writes and reads them)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.fleet.rollout.gate import DeviceEnd
from agent.transitions import TransitionTable


class RolloutState(str, enum.Enum):
    """A rollout's lifecycle."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    DONE = "DONE"
    ABORTED = "ABORTED"
    SUPERSEDED = "SUPERSEDED"


#: The reason an operator's abort (``fleet rollout abort``, the console's button) stores, first words:
#: ``/metrics`` tells it from the gate's or a timeout's abort by it.
OPERATOR_ABORT = "aborted by the operator"


class WaveState(str, enum.Enum):
    """A wave's lifecycle: it waits, runs, soaks once its devices ended, then holds (DONE) or trips."""

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SOAKING = "SOAKING"
    DONE = "DONE"
    TRIPPED = "TRIPPED"
    CANCELLED = "CANCELLED"


class DeviceStep(str, enum.Enum):
    """Where the controller is with one device (its job's end is ``end_state``)."""

    PLANNED = "PLANNED"
    SENDING = "SENDING"
    SENT = "SENT"
    ENDED = "ENDED"
    CANCELLED = "CANCELLED"


ROLLOUT_MOVES = TransitionTable(
    RolloutState,
    {
        RolloutState.RUNNING: {
            RolloutState.PAUSED,
            RolloutState.DONE,
            RolloutState.ABORTED,
            RolloutState.SUPERSEDED,
        },
        RolloutState.PAUSED: {RolloutState.RUNNING, RolloutState.ABORTED, RolloutState.SUPERSEDED},
        RolloutState.DONE: set(),
        RolloutState.ABORTED: set(),
        RolloutState.SUPERSEDED: set(),
    },
    kind="rollout",
)
WAVE_MOVES = TransitionTable(
    WaveState,
    {
        WaveState.WAITING: {WaveState.RUNNING, WaveState.CANCELLED},
        WaveState.RUNNING: {WaveState.SOAKING, WaveState.DONE, WaveState.TRIPPED, WaveState.CANCELLED},
        WaveState.SOAKING: {WaveState.DONE, WaveState.TRIPPED, WaveState.CANCELLED},
        WaveState.DONE: set(),
        WaveState.TRIPPED: set(),
        WaveState.CANCELLED: set(),
    },
    kind="wave",
)
DEVICE_MOVES = TransitionTable(
    DeviceStep,
    {
        DeviceStep.PLANNED: {DeviceStep.SENDING, DeviceStep.ENDED, DeviceStep.CANCELLED},
        # SENDING -> SENDING: a resend after a crash, same job id.
        DeviceStep.SENDING: {DeviceStep.SENDING, DeviceStep.SENT, DeviceStep.ENDED},
        DeviceStep.SENT: {DeviceStep.ENDED},
        DeviceStep.ENDED: set(),
        DeviceStep.CANCELLED: set(),
    },
    kind="rollout device",
)
#: Rollouts that still own their devices' slot.
OPEN_STATES = (RolloutState.RUNNING.value, RolloutState.PAUSED.value)


@dataclass(frozen=True)
class RolloutPlan:
    """A new rollout: id, slot, the job id its desired states carry, the version, the waves of devices."""

    rollout_id: str
    slot: str
    job_id: str
    to_version: str
    waves: Sequence[Sequence[str]]
    from_versions: Mapping[str, str | None] = field(default_factory=dict)
    spec: Mapping[str, Any] = field(default_factory=dict)
    supersedes: str | None = None


@dataclass(frozen=True)
class RolloutRow:
    """A rollout as stored."""

    rollout_id: str
    slot: str
    job_id: str
    to_version: str
    state: RolloutState
    spec: dict[str, Any]
    reason: str
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class DeviceRow:
    """One device of a rollout as stored."""

    device: str
    wave: int
    from_version: str | None
    to_version: str
    job_id: str
    step: DeviceStep
    end: DeviceEnd | None
    figures: dict[str, Any] | None
    sends: int
    sent_at: float | None
    ended_at: float | None


@dataclass(frozen=True)
class WaveRow:
    """One wave as stored: its state, gate figures and reason, when it started and ended."""

    index: int
    state: WaveState
    figures: dict[str, Any] | None
    reason: str
    started_at: float | None
    ended_at: float | None


@dataclass(frozen=True)
class ResumePoint:
    """Where a restarted controller picks a rollout up: the current wave and its devices by step."""

    rollout_id: str
    state: RolloutState
    wave: int | None  # the running (or soaking) wave; None before the first or after the last
    wave_state: WaveState | None
    to_send: tuple[str, ...]  # PLANNED: never published
    resend: tuple[str, ...]  # SENDING: maybe published; publish again with the same job id
    waiting: tuple[str, ...]  # SENT: wait for the job's end
    ended: tuple[str, ...]
