"""What a slot's model really runs as (:class:`~agent.protocol.messages.RunsInfo`), read from an
engine build's ``effective`` report (pure).

The device says it twice from the same report: in ``up/info`` per slot and in the job status of a
deployment once its engine is built, so ``fleet status``, a rollout's gate and the console read one
account of "asked X, running Y, because Z".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.protocol.messages import EngineSource, RunsInfo

#: Longest fallback reason a device sends (the guard's reason and the plan's together).
FALLBACK_CHARS = 300
#: Precisions a build may ask for that name one precision; ``best`` lets the planner choose.
_EXACT = frozenset({"fp32", "fp16", "int8"})


def runs_of(effective: Mapping[str, Any] | None) -> RunsInfo:
    """What an engine with this ``effective`` report runs as: ``built`` (here or found in this
    device's cache) or ``downloaded`` (``engine_source.origin``), ``model`` when no build was asked
    (no ``requested``), and a fallback reason whenever it runs another precision than asked."""
    effective = effective or {}
    requested_spec = effective.get("requested")
    requested = _text(requested_spec.get("precision")) if isinstance(requested_spec, Mapping) else None
    # Without a build the ONNX model runs in its own types: no precision was chosen for it.
    precision = _text(effective.get("precision")) if requested is not None else None
    origin = effective.get("engine_source")
    source: EngineSource = "model" if requested is None else "built"
    if isinstance(origin, Mapping) and origin.get("origin") == "downloaded":
        source = "downloaded"
    fallback = None
    if requested in _EXACT and precision is not None and precision != requested:
        fallback = _why(effective, requested, precision)
    return RunsInfo(requested=requested, precision=precision, source=source, fallback=fallback)


def interim_runs(requested: str | None) -> RunsInfo:
    """A slot serving its ONNX model while the engine asked for (``requested`` precision) builds."""
    return RunsInfo(requested=requested, source="interim")


def _why(effective: Mapping[str, Any], requested: str, precision: str) -> str:
    """The reasons the engine runs ``precision`` although ``requested`` was asked for: the INT8
    guard's refusal first (it decided), then the planner's precision changes, then a backend
    fallback; a plain "asked X, running Y" when the report names none."""
    reasons: list[str] = []
    guard = effective.get("int8_guard")
    if isinstance(guard, Mapping) and guard.get("passed") is False:
        reasons.append(f"INT8 accuracy guard: {_text(guard.get('reason')) or 'refused'}")
    changes = effective.get("changes")
    reasons.extend(
        str(change["reason"])
        for change in (changes if isinstance(changes, list) else [])
        if isinstance(change, Mapping) and change.get("field") == "precision" and change.get("reason")
    )
    backend = effective.get("fallback")
    if isinstance(backend, Mapping) and backend.get("reason"):
        reasons.append(f"{backend.get('from', '?')} -> {backend.get('to', '?')}: {backend['reason']}")
    text = "; ".join(reasons) or f"{requested} asked, {precision} built"
    return text[:FALLBACK_CHARS]


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
