"""What a rollout's devices really run against the precision it asked for: each device's ``runs``
(its job status's report: precision asked and running, engine source, fallback) as the store keeps
it, the counts ``fleet rollout status`` and the console show, and the line a finished rollout ends
with when devices run another precision than asked ("int8 asked, no device runs int8"). Pure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from agent.fleet.base.untrusted import shown
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceRow, DeviceStep
from agent.protocol.messages import RunsInfo

#: Characters of a precision name and of a fallback reason the store keeps (a device chose them).
PRECISION_CHARS = 16
REASON_CHARS = 300
#: Devices running another precision than asked that a status document names.
MAX_FELL_BACK = 50


def requested_precision(request: Mapping[str, Any]) -> str | None:
    """The precision a stored rollout request's build asked for (None: no build asked)."""
    build = request.get("build")
    precision = build.get("precision", "best") if isinstance(build, Mapping) else None
    return str(precision) if precision is not None else None


def stored_runs(runs: RunsInfo) -> dict[str, Any]:
    """``runs`` as the rollout store keeps it: every string cut to a known size."""
    kept = runs.model_dump(mode="json", exclude_none=True)
    for key in ("requested", "precision"):
        if key in kept:
            kept[key] = kept[key][:PRECISION_CHARS]
    if "fallback" in kept:
        kept["fallback"] = kept["fallback"][:REASON_CHARS]
    return kept


def runs_of_figures(figures: Mapping[str, Any] | None) -> RunsInfo | None:
    """The ``runs`` a device's stored figures carry (None: none stored, or one this version cannot read)."""
    runs = (figures or {}).get("runs")
    if not isinstance(runs, Mapping):
        return None
    try:
        return RunsInfo.model_validate(runs)
    except ValidationError:
        return None


def precision_summary(rows: Sequence[DeviceRow], requested: str | None) -> dict[str, Any] | None:
    """What the rollout's ACTIVE devices run against ``requested`` (the build's precision; None: no
    build asked, no summary): ``requested``, ``running`` (devices per precision), ``sources``
    (devices per engine source), ``fell_back`` (the first :data:`MAX_FELL_BACK` devices running
    another precision, each with ``device``, ``wave`` from 1, ``running`` and ``reason``) and
    ``fell_back_count`` and ``fell_back_to`` (those devices per precision)."""
    if requested is None:
        return None
    running: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    fell_back: list[dict[str, Any]] = []
    fell_to: Counter[str] = Counter()
    for row in sorted(rows, key=lambda r: (r.wave, r.device)):
        if row.step is not DeviceStep.ENDED or row.end is not DeviceEnd.ACTIVE:
            continue
        runs = runs_of_figures(row.figures)
        if runs is None:
            continue
        running[runs.precision or "model"] += 1
        sources[runs.source] += 1
        if runs.fallback is not None:
            fell_to[runs.precision or "model"] += 1
            fell_back.append(
                {
                    "device": row.device,
                    "wave": row.wave + 1,
                    "running": runs.precision,
                    "reason": runs.fallback,
                }
            )
    return {
        "requested": requested,
        "running": dict(sorted(running.items())),
        "sources": dict(sorted(sources.items())),
        "fell_back": fell_back[:MAX_FELL_BACK],
        "fell_back_count": len(fell_back),
        "fell_back_to": dict(sorted(fell_to.items())),
    }


def end_note(summary: Mapping[str, Any] | None) -> str:
    """How a finished rollout's precision ended, for its reason: "" when every device that reported
    runs what was asked; ``int8 asked, no device runs int8 (3 fell back to fp32)``; ``int8 asked,
    2 of 5 devices run another precision (fp32 2)``."""
    if not summary or not summary["fell_back_count"]:
        return ""
    requested = shown(summary["requested"], PRECISION_CHARS)
    running: Mapping[str, int] = summary["running"]
    reported = sum(running.values())
    lower: Mapping[str, int] = summary["fell_back_to"]
    to = ", ".join(f"{shown(p, PRECISION_CHARS)} {n}" for p, n in sorted(lower.items()))
    if running.get(summary["requested"], 0) == 0:
        if len(lower) == 1:
            to = f"to {shown(next(iter(lower)), PRECISION_CHARS)}"
        return f"{requested} asked, no device runs {requested} ({summary['fell_back_count']} fell back {to})"
    return (
        f"{requested} asked, {summary['fell_back_count']} of {reported} devices run another precision ({to})"
    )


def precision_lines(summary: Mapping[str, Any] | None, limit: int = 20) -> list[str]:
    """``fleet rollout status``'s lines: what the ACTIVE devices run, then a line per device that
    runs another precision than asked, with why."""
    if not summary or not summary["running"]:
        return []
    running = ", ".join(f"{shown(p, PRECISION_CHARS)} {n}" for p, n in summary["running"].items())
    sources = ", ".join(f"{shown(s, 16)} {n}" for s, n in summary["sources"].items())
    lines = [
        f"  precision: {shown(summary['requested'], PRECISION_CHARS)} asked; running {running} ({sources})"
    ]
    lines.extend(
        f"    {shown(entry['device'], 64)}  wave {entry['wave']}  runs "
        f"{shown(entry['running'] or '?', PRECISION_CHARS)}: {shown(entry['reason'], 200)}"
        for entry in summary["fell_back"][:limit]
    )
    if summary["fell_back_count"] > limit:
        lines.append(f"    ... and {summary['fell_back_count'] - limit} more")
    return lines
