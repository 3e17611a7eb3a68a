"""A configuration overlay merged over the agent's own file: the one merge rule, pure.

Maps merge key by key (an overlay sets only what it names); any other value, a list included,
replaces the file's value whole; ``null`` removes the key (back to its default, or a stream or
slot removed). What an overlay may set at all is decided where it is delivered
(:mod:`agent.lifecycle.config`), not here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def merge_overlay(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overlay`` merged over it (neither is changed)."""
    merged = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_overlay(merged[key], value)
        else:
            merged[key] = copy.deepcopy(_without_nulls(value))
    return merged


def _without_nulls(value: Any) -> Any:
    # A map that replaces nothing is taken as written, less the keys it removes (nothing to remove).
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value
