"""The gate between waves: done or not, holds or trips, figures and reason (agent/fleet/rollout/gate.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from agent.fleet.rollout.gate import DeviceEnd, DeviceReport, GatePolicy, TimeoutPolicy, judge_wave, unhealth
from agent.fleet.rollout.spec import RolloutRequest
from agent.fleet.rollout.waves import parse_max_failed
from agent.protocol.messages import FailedFigure, JobState, ProbationFigures, RunsInfo, ShadowFigures

A, F, R, RB, P, S = (
    DeviceEnd.ACTIVE,
    DeviceEnd.FAILED,
    DeviceEnd.REJECTED,
    DeviceEnd.ROLLED_BACK,
    DeviceEnd.PENDING,
    DeviceEnd.SUPERSEDED,
)


def _wave(
    *ends: DeviceEnd, started: bool = True, online: bool = True, prefix: str = "d"
) -> list[DeviceReport]:
    return [
        DeviceReport(f"{prefix}{index}", end, started=started, online=online)
        for index, end in enumerate(ends)
    ]


@dataclass(frozen=True)
class Case:
    name: str
    wave: list[DeviceReport]
    max_failed: str
    done: bool
    gate: str
    reason: str
    earlier: tuple[DeviceReport, ...] = ()
    timed_out: bool = False
    on_timeout: TimeoutPolicy = "skip"


CASES = [
    Case(
        "all active",
        _wave(A, A, A, A, A),
        "0",
        True,
        "holds",
        "gate holds: 0 failed + 0 rolled back + 0 unhealthy",
    ),
    Case("one pending", _wave(A, A, P), "0", False, "holds", "waiting for 1 of 3 devices"),
    Case(
        "failures at the limit",
        _wave(A, F, RB, A),
        "2",
        True,
        "holds",
        "1 failed + 1 rolled back + 0 unhealthy = 2",
    ),
    Case("rejected counts as failed", _wave(A, R, A), "0", True, "trips", "gate trips: 1 failed"),
    Case(
        "2% of a 5-canary allows none",
        _wave(A, A, A, A, RB),
        "2%",
        True,
        "trips",
        "limit 0 (--max-failed 2%)",
    ),
    Case("trips before the wave is done", _wave(F, F, P, P), "1", False, "trips", "gate trips: 2 failed"),
    Case("superseded counts neither way", _wave(A, S), "0", True, "holds", "gate holds"),
    Case(
        "earlier waves count toward the limit",
        _wave(A, F),
        "1",
        True,
        "trips",
        "2 failed + 0 rolled back + 0 unhealthy = 2 of 4 touched, limit 1",
        earlier=tuple(_wave(A, F, prefix="e")),
    ),
    Case(
        "timeout skips devices that never started",
        _wave(A, A, P, started=True)[:2] + _wave(P, started=False, online=False, prefix="off"),
        "0",
        True,
        "holds",
        "1 skipped (offline at the timeout)",
        timed_out=True,
    ),
    Case(
        "timeout waits for them when asked",
        _wave(A, A) + _wave(P, started=False, online=False, prefix="off"),
        "0",
        False,
        "holds",
        "waiting for 1 of 3 devices",
        timed_out=True,
        on_timeout="wait",
    ),
    Case(
        "a device stuck in its job at the timeout counts as failed",
        _wave(A, A, P),
        "0",
        True,
        "trips",
        "1 failed",
        timed_out=True,
    ),
    Case(
        "a device gone offline mid-job is skipped, not failed",
        _wave(A, A) + _wave(P, started=True, online=False, prefix="off"),
        "0",
        True,
        "holds",
        "1 skipped",
        timed_out=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_gate_table(case: Case) -> None:
    policy = GatePolicy(parse_max_failed(case.max_failed), on_timeout=case.on_timeout)
    verdict = judge_wave(case.wave, case.earlier, policy, timed_out=case.timed_out)
    assert (verdict.done, verdict.gate) == (case.done, case.gate), verdict.reason
    assert case.reason in verdict.reason


def test_timeout_names_the_skipped_and_timed_out_devices() -> None:
    wave = [
        DeviceReport("ok", A, started=True),
        DeviceReport("stuck", P, started=True, online=True),
        DeviceReport("away", P, started=False, online=False),
    ]
    verdict = judge_wave(wave, [], GatePolicy(parse_max_failed("1")), timed_out=True)
    assert verdict.skipped == ("away",)
    assert verdict.timed_out == ("stuck",)
    assert verdict.figures.ends == {"ACTIVE": 1, "TIMED_OUT": 1, "SKIPPED": 1}
    assert (verdict.done, verdict.gate, verdict.figures.failed) == (True, "holds", 1)


@pytest.mark.parametrize("on_timeout", ["wait", "skip"])
def test_a_device_that_starts_after_the_timeout_is_not_timed_out(on_timeout: TimeoutPolicy) -> None:
    """Issue 19.2: the late device's QUEUED arrives after the wave timed out. With ``wait`` it is
    waited for to its end and judged by that end; with ``skip`` it is skipped, as when it was offline."""
    policy = GatePolicy(parse_max_failed("0"), on_timeout=on_timeout, needs_shadow=True, needs_probation=True)
    ok = DeviceReport("ok", A, started=True, shadow=_shadow(0.97), probation=_probation())
    late = DeviceReport("late", P, started=True, late=True)
    working = judge_wave([ok, late], [], policy, timed_out=True)
    assert working.gate == "holds", working.reason
    assert working.timed_out == ()
    if on_timeout == "skip":
        assert (working.done, working.skipped) == (True, ("late",))
        return
    assert (working.done, working.skipped) == (False, ())
    assert "waiting for 1 of 2 devices" in working.reason
    ended = replace(late, end=A, shadow=_shadow(0.95), probation=_probation())
    done = judge_wave([ok, ended], [], policy, timed_out=True)
    assert (done.done, done.gate, done.figures.ends) == (True, "holds", {"ACTIVE": 2})
    # Its end counts as any end does: a late starter that fails trips the gate.
    failed = judge_wave([ok, replace(late, end=F)], [], policy, timed_out=True)
    assert failed.gate == "trips"
    # Without ``late`` the same report is a device stuck in its job since before the timeout.
    stuck = judge_wave([ok, replace(late, late=False)], [], policy, timed_out=True)
    assert (stuck.gate, stuck.timed_out) == ("trips", ("late",))


def _shadow(agreement: float | None) -> ShadowFigures:
    return ShadowFigures(frames=50, agreement=agreement, latency_ratio=1.1)


def _probation(failed: FailedFigure | None = None) -> ProbationFigures:
    return ProbationFigures(elapsed_s=60.0, probation_s=60.0, failed=failed)


@pytest.mark.parametrize(
    ("shadow", "probation", "unhealthy"),
    [
        (_shadow(0.95), _probation(), None),
        (_shadow(0.80), _probation(), "shadow agreement 0.8 below 0.9"),
        (_shadow(None), _probation(), "shadow agreement None below 0.9"),
        # ACTIVE without the figures (an empty slot skips both; an end read from an older ledger):
        # the device's own verdict stands.
        (None, _probation(), None),
        (_shadow(0.95), None, None),
        (None, None, None),
        (
            _shadow(0.95),
            _probation(FailedFigure(figure="p99_ratio", value=4.2, bar=3.0)),
            "probation p99_ratio 4.2",
        ),
    ],
)
def test_active_devices_are_judged_on_their_shadow_and_probation_figures(
    shadow: ShadowFigures | None, probation: ProbationFigures | None, unhealthy: str | None
) -> None:
    policy = GatePolicy(parse_max_failed("0"), needs_shadow=True, min_agreement=0.9, needs_probation=True)
    report = DeviceReport("d0", A, started=True, shadow=shadow, probation=probation)
    reason = unhealth(report, policy)
    if unhealthy is None:
        assert reason is None
    else:
        assert unhealthy in (reason or "")
    healthy = [
        DeviceReport(f"x{i}", A, started=True, shadow=_shadow(0.99), probation=_probation()) for i in range(2)
    ]
    verdict = judge_wave([report, *healthy], [], policy)
    assert verdict.gate == ("holds" if unhealthy is None else "trips")
    assert verdict.unhealthy == (() if unhealthy is None else ("d0",))


def test_3_percent_unhealthy_canaries_trip_a_2_percent_gate() -> None:
    """Scenario 4 of issue 11 on 100 canaries: 3 unhealthy among 100 exceed 2 %."""
    policy = GatePolicy(parse_max_failed("2%"), needs_shadow=True, min_agreement=0.9)
    wave = [
        DeviceReport(f"c{i}", A, started=True, shadow=_shadow(0.5 if i < 3 else 0.97)) for i in range(100)
    ]
    verdict = judge_wave(wave, [], policy)
    assert (verdict.gate, verdict.figures.unhealthy, verdict.figures.limit) == ("trips", 3, 2)
    assert verdict.figures.min_agreement_seen == 0.5


def test_figures_are_not_asked_for_when_the_rollout_does_not_ask() -> None:
    verdict = judge_wave(_wave(A, A), [], GatePolicy(parse_max_failed("0")))
    assert verdict.gate == "holds"


@pytest.mark.parametrize(
    ("state", "end"),
    [(JobState.ACTIVE, A), (JobState.BUILDING, P), (JobState.PROBATION, P), (JobState.ROLLED_BACK, RB)],
)
def test_a_job_state_maps_to_its_end(state: JobState, end: DeviceEnd) -> None:
    assert DeviceEnd.of_job(state) is end


def test_the_verdict_docs_fleet_md_shows_is_the_one_given() -> None:
    policy = GatePolicy(parse_max_failed("2%"), needs_shadow=True, min_agreement=0.9)
    wave = [
        DeviceReport("f", F, started=True),
        DeviceReport("rb", RB, started=True),
        DeviceReport("sick", A, started=True, shadow=_shadow(0.2)),
        *(DeviceReport(f"ok{i}", A, started=True, shadow=_shadow(0.99)) for i in range(97)),
    ]
    doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    assert f"`{judge_wave(wave, [], policy).reason}`" in " ".join(doc.split())


def test_the_gate_text_counts_a_device_never_reached_apart_from_the_touched_ones() -> None:
    """Issue 22.6: '0 of 4 touched ... 1 skipped' counted the skipped device as touched."""
    policy = GatePolicy(parse_max_failed("0"))
    wave = _wave(A, A, A) + _wave(P, started=False, online=False, prefix="off")

    waiting = judge_wave(wave, [], policy)
    skipped = judge_wave(wave, [], policy, timed_out=True)
    reached = judge_wave(_wave(A, A, A, A), [], policy)

    assert "= 0 of 3 touched (1 not reached), limit 0" in waiting.reason
    assert skipped.reason == (
        "gate holds: 0 failed + 0 rolled back + 0 unhealthy = 0 of 3 touched (1 not reached), limit 0 "
        "(--max-failed 0); 1 skipped (offline at the timeout)"
    )
    assert "= 0 of 4 touched, limit 0" in reached.reason


def _fell_back(device: str) -> DeviceReport:
    """An ACTIVE device whose job runs FP32 although INT8 was asked (its guard refused the engine)."""
    runs = RunsInfo(requested="int8", precision="fp32", source="built", fallback="INT8 accuracy guard: 18.8%")
    return DeviceReport(device, A, started=True, runs=runs)


def test_a_precision_fallback_counts_against_the_limit_only_when_the_rollout_says_fail() -> None:
    wave = [_fell_back("d0"), DeviceReport("d1", A, started=True)]
    allowed = judge_wave(wave, [], GatePolicy(parse_max_failed("0")))
    assert (allowed.gate, allowed.figures.unhealthy) == ("holds", 0)
    # Allowed, not silent: the gate's reason names them.
    assert allowed.reason == (
        "gate holds: 0 failed + 0 rolled back + 0 unhealthy = 0 of 2 touched, limit 0 (--max-failed 0); "
        "1 run another precision than asked (--precision-fallback allow)"
    )
    strict = GatePolicy(parse_max_failed("0"), precision_fallback="fail")
    tripped = judge_wave(wave, [], strict)
    assert (tripped.gate, tripped.figures.unhealthy, tripped.unhealthy) == ("trips", 1, ("d0",))
    assert tripped.reason.startswith(
        "gate trips: 0 failed + 0 rolled back + 1 unhealthy (1 run another precision than asked) = 1 of 2"
    )
    assert unhealth(wave[0], strict) == "runs fp32, int8 asked"
    # A device that runs what was asked (or said nothing of it) is no fallback.
    asked = RunsInfo(requested="int8", precision="int8", source="downloaded")
    assert unhealth(DeviceReport("d2", A, runs=asked), strict) is None
    assert unhealth(DeviceReport("d3", A), strict) is None
    # A device that failed is counted as failed, not twice.
    failed = replace(_fell_back("d4"), end=F)
    assert judge_wave([failed], [], strict).figures.unhealthy == 0


def test_a_rollout_request_carries_its_precision_fallback_to_the_gate() -> None:
    request = {
        "model_sha256": "0" * 64,
        "model_name": "m.onnx",
        "slot": "main",
        "version": "2",
        "devices": ["d0"],
    }
    assert RolloutRequest.model_validate(request).policy().precision_fallback == "allow"
    strict = RolloutRequest.model_validate({**request, "precision_fallback": "fail"})
    assert strict.policy().precision_fallback == "fail"
    with pytest.raises(ValueError, match="precision_fallback"):
        RolloutRequest.model_validate({**request, "precision_fallback": "sometimes"})
