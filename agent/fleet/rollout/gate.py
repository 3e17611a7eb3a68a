"""The health gate between two waves of a rollout (pure: reports in, a verdict out).

The controller hands over where every device of the rollout so far stands (its job's end, or that it
is still pending and whether it is online) and the figures its job statuses carried; :func:`judge_wave`
says whether the current wave is done, whether the gate holds or trips, with the figures and a reason.

What counts against the limit (``--max-failed``, of the devices touched so far):

- a job that ended ``FAILED``, ``REJECTED`` or ``ROLLED_BACK`` (the device refused or undid the model);
- a device that is *unhealthy*: it ended ``ACTIVE`` but the shadow or probation figures it reported
  contradict that end: agreement below the rollout's ``min_agreement``, or a failed probation figure;
- a device still working on its job (online, not ended) when the wave timed out (``TIMED_OUT``);
- with ``precision_fallback="fail"``, a device that ended ``ACTIVE`` running another precision than
  the build asked (its job's ``runs.fallback``: an INT8 engine its accuracy guard refused), counted
  as unhealthy. With ``"allow"`` (the default) such a device is reported, not counted.

A device that never started (offline, no job status yet) when the wave times out is no failure: with
``on_timeout="skip"`` it is listed in ``skipped`` and the wave is done (the retained desired state
still reaches it when it comes back); with ``"wait"`` the wave stays open until it ends. It stays
waited for once it starts after the timeout (``late``): its job is not "still working when the wave
timed out", so it is judged by how it ends, like any device that started in time.
``SUPERSEDED`` (a newer desired state replaced the job) counts neither way.

An ``ACTIVE`` end is the device's own verdict: it runs the shadow and probation its manifest asks
for, against the same bars, and ends ``REJECTED`` or ``ROLLED_BACK`` when they fail. So the figures
are a second look, not a condition: an ``ACTIVE`` device without them (a deploy on an empty slot
skips both; a device asked with ``status`` by an older controller or answering from an older ledger
gives its end without them) is judged by its end, and only figures that say otherwise count.

The gate trips as soon as the bad ends exceed the limit, even before the wave is done: waiting for
the rest cannot make it hold again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from agent.fleet.rollout.waves import FailureLimit
from agent.protocol.messages import JobState, ProbationFigures, RunsInfo, ShadowFigures

#: What a wave's timeout does to its devices that have not ended: skip them, or keep waiting.
TimeoutPolicy = Literal["skip", "wait"]


class DeviceEnd(str, enum.Enum):
    """Where one device of a rollout stands, as the gate sees it."""

    PENDING = "PENDING"  # desired state sent, job not ended (or not started: see ``online``)
    ACTIVE = "ACTIVE"
    FAILED = "FAILED"
    REJECTED = "REJECTED"
    ROLLED_BACK = "ROLLED_BACK"
    SUPERSEDED = "SUPERSEDED"
    TIMED_OUT = "TIMED_OUT"  # still working on its job when the wave timed out
    SKIPPED = "SKIPPED"  # never started before the wave timed out (offline); not a failure

    @classmethod
    def of_job(cls, state: JobState) -> DeviceEnd:
        """The end a job state means: a terminal state maps to itself, the others to PENDING."""
        return cls(state.value) if state.terminal else cls.PENDING


#: Ends that count against ``--max-failed`` (besides unhealthy ACTIVE devices).
BAD_ENDS = frozenset({DeviceEnd.FAILED, DeviceEnd.REJECTED, DeviceEnd.ROLLED_BACK, DeviceEnd.TIMED_OUT})
#: Ends after which a device needs nothing more from its wave.
FINAL_ENDS = frozenset(DeviceEnd) - {DeviceEnd.PENDING}


@dataclass(frozen=True)
class DeviceReport:
    """One device of the rollout: its end so far, whether it ever reported on its job, its figures."""

    device: str
    end: DeviceEnd
    started: bool = False  # a job status arrived for it (it is working, not merely offline)
    online: bool = True
    shadow: ShadowFigures | None = None
    probation: ProbationFigures | None = None
    #: It had not started when the wave timed out: its first job status came later (the runner
    #: knows who had not started at that moment; the gate cannot tell from ``started`` alone).
    late: bool = False
    #: What its job says it runs (precision asked and running, any fallback), once built.
    runs: RunsInfo | None = None


@dataclass(frozen=True)
class GatePolicy:
    """What the rollout asks of its devices: the failure limit and the figures an ACTIVE end needs."""

    max_failed: FailureLimit
    on_timeout: TimeoutPolicy = "skip"
    needs_shadow: bool = False
    min_agreement: float | None = None
    needs_probation: bool = False
    #: ``fail``: a device running another precision than asked counts as unhealthy.
    precision_fallback: Literal["allow", "fail"] = "allow"


@dataclass(frozen=True)
class GateFigures:
    """Counts the verdict rests on, over the devices touched so far (earlier waves and this one)."""

    touched: int
    ends: dict[str, int]
    failed: int  # FAILED + REJECTED + TIMED_OUT
    rolled_back: int
    unhealthy: int
    limit: int
    min_agreement_seen: float | None = None


@dataclass(frozen=True)
class WaveVerdict:
    """The gate's answer: ``done`` (every device of the wave ended, or was skipped), ``gate``."""

    done: bool
    gate: Literal["holds", "trips"]
    reason: str
    figures: GateFigures
    skipped: tuple[str, ...] = ()
    timed_out: tuple[str, ...] = ()
    unhealthy: tuple[str, ...] = field(default=())


def unhealth(report: DeviceReport, policy: GatePolicy) -> str | None:
    """Why an ACTIVE device is unhealthy for this rollout, or None: its own verdict (ACTIVE) stands
    unless figures it reported contradict it (missing figures do not: see the module docstring)."""
    if report.end is not DeviceEnd.ACTIVE:
        return None
    if policy.needs_shadow and report.shadow is not None:
        agreement = report.shadow.agreement
        if policy.min_agreement is not None and (agreement is None or agreement < policy.min_agreement):
            return f"shadow agreement {agreement} below {policy.min_agreement}"
    if policy.needs_probation and report.probation is not None and report.probation.failed is not None:
        failed = report.probation.failed
        return f"probation {failed.figure} {failed.value:g} crossed {failed.bar:g}"
    if policy.precision_fallback == "fail" and (why := fell_back(report)) is not None:
        return why
    return None


def fell_back(report: DeviceReport) -> str | None:
    """``runs fp32, int8 asked`` when the device's job runs another precision than asked, else None."""
    runs = report.runs
    if runs is None or runs.fallback is None:
        return None
    return f"runs {runs.precision}, {runs.requested} asked"


def _after_timeout(report: DeviceReport, policy: GatePolicy) -> DeviceReport:
    if report.end is not DeviceEnd.PENDING:
        return report
    if report.started and report.online and not report.late:
        return DeviceReport(report.device, DeviceEnd.TIMED_OUT, report.started, report.online)
    if policy.on_timeout == "skip":
        return DeviceReport(report.device, DeviceEnd.SKIPPED, report.started, report.online)
    return report


def judge_wave(
    wave: Sequence[DeviceReport],
    earlier: Sequence[DeviceReport],
    policy: GatePolicy,
    *,
    timed_out: bool = False,
) -> WaveVerdict:
    """Judge the current ``wave`` (with the ``earlier`` waves' devices counting toward the limit).

    ``timed_out``: the wave's timeout has passed; its pending devices become TIMED_OUT (working on
    the job since before the timeout) or, by ``policy.on_timeout``, SKIPPED (not started at the
    timeout) or still PENDING (``"wait"``, ``late`` ones included until they end).
    """
    current = [_after_timeout(report, policy) for report in wave] if timed_out else list(wave)
    everyone = [*earlier, *current]
    ends: dict[str, int] = {}
    for report in everyone:
        ends[report.end.value] = ends.get(report.end.value, 0) + 1
    unhealthy = tuple(r.device for r in everyone if unhealth(r, policy) is not None)
    rolled_back = ends.get(DeviceEnd.ROLLED_BACK.value, 0)
    failed = sum(ends.get(end.value, 0) for end in BAD_ENDS) - rolled_back
    agreements = [
        r.shadow.agreement for r in everyone if r.shadow is not None and r.shadow.agreement is not None
    ]
    figures = GateFigures(
        touched=len(everyone),
        ends=ends,
        failed=failed,
        rolled_back=rolled_back,
        unhealthy=len(unhealthy),
        limit=policy.max_failed.allowed(len(everyone)),
        min_agreement_seen=min(agreements) if agreements else None,
    )
    bad = figures.failed + figures.rolled_back + figures.unhealthy
    done = all(report.end in FINAL_ENDS for report in current)
    skipped = tuple(r.device for r in current if r.end is DeviceEnd.SKIPPED)
    stuck = tuple(r.device for r in current if r.end is DeviceEnd.TIMED_OUT)
    # The text counts only the devices the job reached: a skipped one (offline at the timeout) or one
    # not started yet is named apart, not counted as touched. The limit stays the figures'.
    unreached = sum(1 for r in everyone if _unreached(r))
    not_reached = f" ({unreached} not reached)" if unreached else ""
    # Devices serving another precision than asked are named either way: counted (fail) or not (allow).
    lower = sum(1 for r in everyone if r.end is DeviceEnd.ACTIVE and fell_back(r) is not None)
    counted = policy.precision_fallback == "fail"
    precision = f" ({lower} run another precision than asked)" if lower and counted else ""
    allowed = (
        f"; {lower} run another precision than asked (--precision-fallback allow)"
        if lower and not counted
        else ""
    )
    summary = (
        f"{figures.failed} failed + {figures.rolled_back} rolled back + {figures.unhealthy} unhealthy"
        f"{precision} "
        f"= {bad} of {figures.touched - unreached} touched{not_reached}, limit {figures.limit} "
        f"(--max-failed {policy.max_failed}){allowed}"
    )
    if bad > figures.limit:
        return WaveVerdict(done, "trips", f"gate trips: {summary}", figures, skipped, stuck, unhealthy)
    if not done:
        waiting = sum(1 for r in current if r.end is DeviceEnd.PENDING)
        reason = f"waiting for {waiting} of {len(current)} devices; so far {summary}"
        return WaveVerdict(done, "holds", reason, figures, skipped, stuck, unhealthy)
    extra = f"; {len(skipped)} skipped (offline at the timeout)" if skipped else ""
    return WaveVerdict(done, "holds", f"gate holds: {summary}{extra}", figures, skipped, stuck, unhealthy)


def _unreached(report: DeviceReport) -> bool:
    """Never reached by the job: not started, and skipped at the timeout or still pending."""
    return not report.started and report.end in (DeviceEnd.SKIPPED, DeviceEnd.PENDING)
