"""A deployment job's own state table (the job's steps are driven through the service's tests)."""

from __future__ import annotations

import pytest

from agent.delivery.jobs.deployment import JOB_TRANSITIONS
from agent.protocol.messages import JobState
from agent.transitions import IllegalTransitionError


def test_the_job_table_allows_each_step_and_a_failure_end_but_nothing_after_an_end() -> None:
    J = JobState
    JOB_TRANSITIONS.check(J.QUEUED, J.DOWNLOADING)
    JOB_TRANSITIONS.check(J.VALIDATING, J.ROLLED_BACK)
    assert JOB_TRANSITIONS.terminal == {J.ACTIVE, J.FAILED, J.REJECTED, J.ROLLED_BACK, J.SUPERSEDED}
    with pytest.raises(IllegalTransitionError, match="job j1: illegal job transition QUEUED -> BUILDING"):
        JOB_TRANSITIONS.check(J.QUEUED, J.BUILDING, who="job j1")
    with pytest.raises(IllegalTransitionError, match="ACTIVE -> QUEUED"):
        JOB_TRANSITIONS.check(J.ACTIVE, J.QUEUED)
