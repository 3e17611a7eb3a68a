"""A device's message cut to a size known in advance, before the operator side keeps it.

Everything a device sends is untrusted, its size included: an ``up/info`` may carry a platform of a
million keys, a job status a probation ``baseline`` of a million figures, each string megabytes.
:func:`fit` walks such a value (parsed JSON: dicts, lists, strings, numbers) and keeps entries, in
order, while they fit a budget of *estimated bytes*: what CPython holds for them, counted as
:func:`cost` counts it (a string 49 bytes plus its characters, a number 32, a container entry 56
plus its key and value). Every string is also cut to ``text_limit`` characters, keys included.
What did not fit is left out, and the caller learns that something was cut.
"""

from __future__ import annotations

from typing import Any

from agent.fleet.base.untrusted import clipped

#: Estimated bytes of objects as CPython 3.11+ holds them on 64 bits (sys.getsizeof, rounded up;
#: a dict or list entry counts its slot and its share of the table's spare room).
STR_BYTES = 49
NUMBER_BYTES = 32
ENTRY_BYTES = 56
CONTAINER_BYTES = 64


def text_cost(text: str) -> int:
    """Estimated bytes of ``text``: 1 byte a character when ASCII, up to 4 otherwise."""
    return STR_BYTES + len(text) * (1 if text.isascii() else 4)


def cost(value: Any) -> int:
    """Estimated bytes of a parsed-JSON ``value`` as :func:`fit` counts them."""
    if isinstance(value, str):
        return text_cost(value)
    if isinstance(value, dict):
        return CONTAINER_BYTES + sum(ENTRY_BYTES + text_cost(str(k)) + cost(v) for k, v in value.items())
    if isinstance(value, list):
        return CONTAINER_BYTES + sum(ENTRY_BYTES + cost(v) for v in value)
    return NUMBER_BYTES


class _Budget:
    def __init__(self, total: int) -> None:
        self.left = total
        self.cut = False

    def take(self, amount: int) -> bool:
        if amount > self.left:
            self.cut = True
            return False
        self.left -= amount
        return True


def fit(value: Any, budget: int, text_limit: int) -> tuple[Any, bool]:
    """``value`` cut to at most ``budget`` estimated bytes and ``text_limit`` characters a string;
    and whether anything was cut (a string shortened, an entry left out).

    Entries are kept in order until the next one does not fit; a container always fits (empty when
    nothing else does), so the shape stays what the reader expects.
    """
    left = _Budget(budget)
    return _fit(value, left, text_limit), left.cut


def _fit(value: Any, left: _Budget, text_limit: int) -> Any:
    if isinstance(value, str):
        # A string of an entry that was let in is kept, cut to the room left (at least a few characters).
        width = 1 if value.isascii() else 4
        text = clipped(value, min(text_limit, max(8, (left.left - STR_BYTES) // width)))
        if text is not value:
            left.cut = True
        left.left -= text_cost(text)
        return text
    if isinstance(value, dict):
        left.left -= CONTAINER_BYTES
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = clipped(str(key), text_limit)
            if not left.take(ENTRY_BYTES + text_cost(name) + _least(item)):
                break
            left.left += _least(item)  # taken again, fully, by _fit below
            out[name] = _fit(item, left, text_limit)
        return out
    if isinstance(value, list):
        left.left -= CONTAINER_BYTES
        items: list[Any] = []
        for item in value:
            if not left.take(ENTRY_BYTES + _least(item)):
                break
            left.left += _least(item)
            items.append(_fit(item, left, text_limit))
        return items
    left.left -= NUMBER_BYTES
    return value


def _least(value: Any) -> int:
    """The least an entry's value costs once let in (an empty container, a short string)."""
    if isinstance(value, (dict, list)):
        return CONTAINER_BYTES
    if isinstance(value, str):
        return STR_BYTES
    return NUMBER_BYTES
