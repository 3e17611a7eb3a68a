"""``edge-agent info`` as text: one line per platform fact, the reason beside a fact that could not be
read, one line per backend: no Python ``None``, no backend twice."""

from __future__ import annotations

from collections.abc import Mapping

#: Summary keys that repeat what the backend lines say (``backend_<name>``, ``backend_<name>_reason``).
_BACKEND_PREFIX = "backend_"
_REASON_SUFFIX = "_reason"


def info_lines(summary: Mapping[str, object], backends: Mapping[str, tuple[bool, str]]) -> list[str]:
    """The text of ``edge-agent info``: ``key  value``, ``key  -  (why it is unknown)``, then backends."""
    facts = {
        key: value
        for key, value in summary.items()
        if not key.endswith(_REASON_SUFFIX) and not key.startswith(_BACKEND_PREFIX)
    }
    width = max((len(k) for k in facts), default=0)
    unknown = "not a Jetson" if summary.get("is_jetson") is False else "not read"
    lines = []
    for key, value in facts.items():
        reason = summary.get(f"{key}{_REASON_SUFFIX}")
        if value is None:
            lines.append(f"{key:<{width}}  -  ({reason or unknown})")
        else:
            lines.append(f"{key:<{width}}  {_text(value)}")
    name_width = max((len(n) for n in backends), default=0)
    for name, (usable, reason) in sorted(backends.items()):
        lines.append(f"backend {name:<{name_width}}  {'usable' if usable else 'unusable'}: {reason}")
    return lines


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
