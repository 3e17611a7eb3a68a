"""The job side of shadow and probation: states, figures in every status, the end codes, timings.

The slot is the delivery stack's stand-in (tests/delivery/delivery_stack.py) driven by a script that
talks to the job through ``request.guard`` exactly as the runtime does; the runtime side runs for
real in tests/runtime/slots/test_guarded.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.delivery.jobs.deployment import JOB_TRANSITIONS
from agent.delivery.jobs.steps import ActivationRequest
from agent.protocol.delivery_errors import RolledBackError, ShadowRejectedError
from agent.protocol.messages import FailedFigure, JobState, ProbationFigures, ShadowFigures
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.transitions import IllegalTransitionError
from tests.delivery.delivery_stack import Harness, states

J = JobState
SHADOW = ShadowFigures(frames=4, agreement=0.25, latency_ratio=1.1)


def test_shadow_and_probation_are_optional_steps_between_validating_and_active() -> None:
    for old, new in ((J.VALIDATING, J.SHADOW), (J.SHADOW, J.PROBATION), (J.VALIDATING, J.PROBATION)):
        JOB_TRANSITIONS.check(old, new)
    JOB_TRANSITIONS.check(J.SHADOW, J.REJECTED)
    JOB_TRANSITIONS.check(J.PROBATION, J.ROLLED_BACK)
    JOB_TRANSITIONS.check(J.PROBATION, J.ACTIVE)
    with pytest.raises(IllegalTransitionError):
        JOB_TRANSITIONS.check(J.PROBATION, J.SHADOW)
    assert J.SHADOW not in JOB_TRANSITIONS.terminal
    assert J.PROBATION not in JOB_TRANSITIONS.terminal


def test_a_shadow_below_the_bar_ends_rejected_with_its_figures(device: Harness, model_v1: Path) -> None:
    def disagree(request: ActivationRequest) -> None:
        assert request.shadow == ShadowSpec(frames=4)
        assert request.guard is not None
        request.guard.enter(J.SHADOW)
        request.guard.figures(shadow=SHADOW)
        raise ShadowRejectedError("agreement 0.25 is below min_agreement 0.9", code="shadow_disagrees")

    device.activations.guard_script = disagree
    manifest = device.manifest(model_v1, job_id="job-shadow", shadow=ShadowSpec(frames=4))
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal("job-shadow")
    assert states(statuses)[-3:] == [J.VALIDATING, J.SHADOW, J.REJECTED]
    final = statuses[-1]
    assert (final.error_code, final.shadow) == ("shadow_disagrees", SHADOW)
    assert "min_agreement" in (final.error or "")
    assert {"validate", "shadow"} <= set(final.timings_s)


def test_an_unhealthy_probation_ends_rolled_back_naming_the_figure(device: Harness, model_v1: Path) -> None:
    failed = FailedFigure(figure="nan_outputs", value=3, bar=0)

    def unhealthy(request: ActivationRequest) -> None:
        assert (request.probation_s, request.probation) == (5.0, ProbationSpec(max_nan_outputs=0))
        assert request.guard is not None
        request.guard.enter(J.PROBATION)
        request.guard.figures(
            probation=ProbationFigures(
                elapsed_s=1.0, probation_s=5.0, current={"nan_outputs": 3}, failed=failed
            )
        )
        raise RolledBackError("new model unhealthy in probation (nan_outputs = 3, bar 0)")

    device.activations.guard_script = unhealthy
    manifest = device.manifest(model_v1, job_id="job-probation", probation_s=5.0)
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal("job-probation")
    assert states(statuses)[-3:] == [J.VALIDATING, J.PROBATION, J.ROLLED_BACK]
    final = statuses[-1]
    assert final.error_code == "unhealthy"
    assert final.probation is not None
    assert final.probation.failed == failed
    assert "probation" in final.timings_s
    assert device.jobs_json()["slots"]["main"]["state"] == "ROLLED_BACK"


def test_a_healthy_probation_ends_active_with_its_figures(device: Harness, model_v1: Path) -> None:
    def healthy(request: ActivationRequest) -> None:
        assert request.guard is not None
        request.guard.enter(J.SHADOW)
        request.guard.figures(shadow=ShadowFigures(frames=30, agreement=1.0, latency_ratio=1.0))
        request.guard.enter(J.PROBATION)
        request.guard.figures(probation=ProbationFigures(elapsed_s=5.0, probation_s=5.0))

    device.activations.guard_script = healthy
    manifest = device.manifest(model_v1, job_id="job-good", shadow=ShadowSpec(), probation_s=5.0)
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal("job-good")
    assert states(statuses)[-4:] == [J.VALIDATING, J.SHADOW, J.PROBATION, J.ACTIVE]
    final = statuses[-1]
    assert final.shadow is not None
    assert final.shadow.frames == 30
    assert final.probation is not None
    assert final.probation.elapsed_s == 5.0
    assert {"validate", "shadow", "probation"} <= set(final.timings_s)


def test_up_info_is_republished_as_a_job_enters_building_shadow_and_probation_showing_that_job(
    device: Harness, model_v1: Path
) -> None:
    """While a device built or ran a probation, `fleet status` showed the previous job as LAST JOB;
    the agent republishes up/info when a long phase starts (once per phase, not per update)."""

    def guarded(request: ActivationRequest) -> None:
        assert request.guard is not None
        request.guard.enter(J.SHADOW)
        request.guard.figures(shadow=ShadowFigures(frames=30, agreement=1.0, latency_ratio=1.0))
        request.guard.figures(shadow=ShadowFigures(frames=60, agreement=1.0, latency_ratio=1.0))
        request.guard.enter(J.PROBATION)
        request.guard.figures(probation=ProbationFigures(elapsed_s=2.0, probation_s=5.0))
        request.guard.figures(probation=ProbationFigures(elapsed_s=5.0, probation_s=5.0))

    device.activations.guard_script = guarded
    manifest = device.manifest(model_v1, job_id="job-13", shadow=ShadowSpec(), probation_s=5.0)
    device.deploy(device.signed(manifest))
    device.wait_terminal("job-13")

    assert [(f["last_job"], f["last_job_state"]) for f in device.job_phases] == [
        ("job-13", J.BUILDING),
        ("job-13", J.SHADOW),
        ("job-13", J.PROBATION),
    ]
