"""A newer manifest retained while the agent is down ends the job it interrupted (issue 19.5).

Real mosquitto, real ``python -m agent run`` processes, signed deploys pulled in chunks, shadow and
probation on (the defaults operators use). Job A is interrupted at DOWNLOADING, SHADOW or PROBATION
by SIGKILL or SIGTERM; while the agent is down job B (a higher sequence) replaces A's retained
manifest; the restarted agent must end A ``SUPERSEDED`` (once) and run B to ``ACTIVE``: every job id
gets exactly one terminal state (docs/protocol.md, "JobStatus").
"""

from __future__ import annotations

import signal

import pytest

from agent.protocol.messages import JobState, JobStatus
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, Fleet, agent_state, ends_only_shadow, job_statuses
from tests.mqtt_probe import Probe
from tests.waiting import patient

pytestmark = pytest.mark.slow

_LENIENT = ENDS_ONLY_PROBATION  # this test is about job ends, not health
#: A's shadow when it must be caught in it (30 s), and when it must pass on to probation at once.
_LONG_SHADOW = ends_only_shadow(frames=30, sample_fps=1.0, timeout_s=300.0)
_SHORT_SHADOW = ends_only_shadow(frames=3, sample_fps=10.0)


def _unique(probe: Probe, job_id: str, device: str) -> list[JobStatus]:
    """Statuses of ``job_id`` in arrival order; a msg_id seen before (a spool replay) dropped."""
    seen: dict[str, JobStatus] = {}
    for status in job_statuses(probe, job_id, device):
        seen.setdefault(status.msg_id, status)
    return list(seen.values())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.parametrize("step", [JobState.DOWNLOADING, JobState.SHADOW, JobState.PROBATION], ids=str.lower)
def test_a_newer_manifest_retained_while_down_supersedes_the_interrupted_job_once(
    fleet: Fleet, device_id: str, probe: Probe, step: JobState, sig: signal.Signals
) -> None:
    files = fleet.files(device_id)
    daemon = fleet.start(files)
    daemon.wait_for_event("agent.started", timeout=60)
    # A's download is slowed (~12 s for the 25 KB model) only where it must be caught downloading.
    slow = {"max_rate_bps": 2048} if step is JobState.DOWNLOADING else {}
    a = fleet.deploy(
        files.v2,
        [device_id],
        "2",
        chunk_size=1024,
        shadow=_SHORT_SHADOW if step is JobState.PROBATION else _LONG_SHADOW,
        probation_s=300.0,
        probation=_LENIENT,
        **slow,
    )
    probe.wait_for(lambda _m: any(s.state is step for s in _unique(probe, a.job_id, device_id)), timeout=60)
    daemon.signal(sig)
    code = daemon.proc.wait(patient(30))
    a.stop()
    assert code == (0 if sig is signal.SIGTERM else -signal.SIGKILL), daemon.log()[-3000:]
    assert not any(s.state.terminal for s in _unique(probe, a.job_id, device_id))

    # While the agent is down, B replaces A's retained manifest (a higher sequence).
    b = fleet.deploy(files.v2, [device_id], "3", shadow=_SHORT_SHADOW, probation_s=2.0, probation=_LENIENT)
    try:
        restarted = fleet.start(files)
        probe.wait_for(
            lambda _m: any(s.state.terminal for s in _unique(probe, b.job_id, device_id)), timeout=90
        )
        probe.settle(1.0)  # anything the agent would still publish for either job arrives meanwhile
    finally:
        b.stop()
    a_states = [s.state for s in _unique(probe, a.job_id, device_id)]
    b_statuses = _unique(probe, b.job_id, device_id)
    b_states = [s.state for s in b_statuses]
    for job, states in ((a.job_id, a_states), (b.job_id, b_states)):
        assert sum(s.terminal for s in states) == 1, f"{job}: {states}"
        assert states[-1].terminal, f"{job}: published after its end: {states}"
    assert a_states[-1] is JobState.SUPERSEDED, a_states
    superseded = _unique(probe, a.job_id, device_id)[-1]
    assert superseded.error_code == "superseded"
    assert b.job_id in (superseded.error or "")
    assert b_states[0] is JobState.QUEUED, b_states
    assert b_states[-1] is JobState.ACTIVE, [(s.state, s.error_code, s.error) for s in b_statuses]
    assert {JobState.SHADOW, JobState.PROBATION} <= set(b_states), b_states
    active = agent_state(files)["slots"]["cls"]["active"]
    assert active["version"] == "3"  # what serves, and what a restart brings back, is B's model
    assert restarted.stop() == 0, restarted.log()[-3000:]
