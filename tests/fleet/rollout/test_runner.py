"""The rollout runner's pure parts: what the store keeps of a job's figures."""

from __future__ import annotations

import json

from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.rollout.gate import DeviceEnd, DeviceReport, GatePolicy, unhealth
from agent.fleet.rollout.runner import STORED_FIGURES, STORED_NAME_CHARS, job_figures
from agent.fleet.rollout.waves import parse_max_failed
from agent.protocol.messages import FailedFigure, JobState, ProbationFigures


def test_the_store_keeps_a_hostile_devices_job_figures_bounded_and_the_gate_still_sees_the_failure() -> None:
    huge = {f"{i:06d}" + "x" * 5000: float(i) for i in range(10_000)}
    progress = DeviceProgress(
        "jet-h",
        0,
        state=JobState.ROLLED_BACK,
        error_code="e" * 10_000,
        probation=ProbationFigures(
            elapsed_s=3.0,
            probation_s=4.0,
            baseline=huge,
            current=huge,
            failed=FailedFigure(figure="f" * 10_000, value=2.0, bar=1.0),
        ),
    )
    figures = job_figures(progress)
    assert len(json.dumps(figures)) < 2 * STORED_FIGURES * (STORED_NAME_CHARS + 32) + 2_000
    assert len(figures["probation"]["baseline"]) == STORED_FIGURES
    assert len(figures["error_code"]) == STORED_NAME_CHARS
    # What the gate reads of a stored row still says the probation failed.
    report = DeviceReport(
        "jet-h", DeviceEnd.ACTIVE, probation=ProbationFigures.model_validate(figures["probation"])
    )
    assert unhealth(report, GatePolicy(max_failed=parse_max_failed("0"), needs_probation=True))
