"""Which devices of a rollout went wrong, each with its error code and the figure that failed: an
operator needs which device and why, not "REJECTED 1". Pure.

A device counts here when its job ended ``FAILED``, ``REJECTED``, ``ROLLED_BACK`` or ``TIMED_OUT``, or
ended ``ACTIVE`` but is unhealthy by the rollout's own gate (:func:`agent.fleet.rollout.gate.unhealth`): the
same devices the gate counts against ``--max-failed``. The list is bounded (:data:`MAX_LISTED`); the
count of those left off is given beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from agent.fleet.base.untrusted import shown
from agent.fleet.rollout.gate import BAD_ENDS, DeviceEnd, DeviceReport, GatePolicy, unhealth
from agent.fleet.rollout.precision import runs_of_figures
from agent.fleet.rollout.records import DeviceRow, DeviceStep
from agent.protocol.messages import ProbationFigures, ShadowFigures

#: Most devices a status document names (a rollout of 10 000 devices may fail on all of them).
MAX_LISTED = 50
#: Longest device-sent text (error code) kept per device.
_TEXT = 64
#: Longest figure text (it holds a figure name the device sent).
_FIGURE_TEXT = 160


def device_problems(rows: Sequence[DeviceRow], policy: GatePolicy | None) -> tuple[list[dict[str, Any]], int]:
    """(the first :data:`MAX_LISTED` problem devices, how many more there are), in wave order.

    Each entry: ``device``, ``wave`` (from 1), ``end`` (the job's end, or ``UNHEALTHY`` for an
    ``ACTIVE`` device its figures fail), ``error_code`` (the device's, or null) and ``figure`` (what
    failed: a probation figure and its bar, the shadow agreement; null when the device sent none).
    ``policy`` None (a rollout stored without its request) judges no ACTIVE device.
    """
    problems: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: (r.wave, r.device)):
        if row.step is not DeviceStep.ENDED or row.end is None:
            continue
        figures = row.figures or {}
        shadow, probation = _figures(figures)
        if row.end in BAD_ENDS:
            end, figure = row.end.value, _failed_figure(shadow, probation)
        elif row.end is DeviceEnd.ACTIVE and policy is not None:
            runs = runs_of_figures(figures)
            report = DeviceReport(row.device, row.end, shadow=shadow, probation=probation, runs=runs)
            figure = unhealth(report, policy)
            if figure is None:
                continue
            end = "UNHEALTHY"
        else:
            continue
        code = figures.get("error_code")
        problems.append(
            {
                "device": row.device,
                "wave": row.wave + 1,
                "end": end,
                "error_code": shown(code, _TEXT) if isinstance(code, str) else None,
                "figure": shown(figure, _FIGURE_TEXT) if figure else None,  # names a device sent
            }
        )
    return problems[:MAX_LISTED], max(0, len(problems) - MAX_LISTED)


def _figures(figures: dict[str, Any]) -> tuple[ShadowFigures | None, ProbationFigures | None]:
    try:
        shadow = ShadowFigures.model_validate(figures["shadow"]) if figures.get("shadow") else None
        probation = (
            ProbationFigures.model_validate(figures["probation"]) if figures.get("probation") else None
        )
    except ValidationError:  # stored by an older controller in another shape: no figure to show
        return None, None
    return shadow, probation


def _failed_figure(shadow: ShadowFigures | None, probation: ProbationFigures | None) -> str | None:
    """The figure behind a bad end: the probation figure that crossed its bar, else the shadow's
    agreement; None when the device sent neither (it failed before the swap)."""
    if probation is not None and probation.failed is not None:
        failed = probation.failed
        return f"probation {failed.figure} {failed.value:g} crossed {failed.bar:g}"
    if shadow is not None and shadow.agreement is not None:
        return f"shadow agreement {shadow.agreement:g}"
    return None
