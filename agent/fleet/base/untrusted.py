"""Text a device sent, made safe to print on the operator's terminal.

Device ids, model names, versions, job ids, error texts and platform fields are whatever a device
(or whoever holds its credentials) put into its messages. Printed raw, an escape sequence can move
the cursor and draw a fake ``jet-01  ACTIVE  100%`` line over the real one, a ``\\r`` or ``\\b``
can overwrite what came before, a bidi override can make ``ACTIVE`` read backwards, and a 20 MB
field prints 20 MB. :func:`shown` is the one gate all of them pass before the fleet commands print
them: invisible and cursor-moving characters become visible escapes, and the length is capped.
"""

from __future__ import annotations

import unicodedata

#: Default longest text shown for one field (table cells, error lines).
DEFAULT_LIMIT = 80
_ELLIPSIS = "..."

#: Unicode categories printed as escapes: control characters (C0 with TAB/LF/CR/ESC/BS, DEL, C1
#: with CSI 0x9b), format characters (bidi overrides and isolates, zero-width joiners, BOM, soft
#: hyphen), line and paragraph separators, and lone surrogates (which cannot even be encoded to
#: UTF-8: printing one raises UnicodeEncodeError).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except ValueError:
        # str() of an int longer than 4,300 digits raises (CVE-2020-10735 limit); show its size only.
        return f"<number of {value.bit_length() if isinstance(value, int) else '?'} bits>"


def shown(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """``value`` as one line of printable text of at most ``limit`` characters.

    Control, format and separator characters become ``\\x1b``, ``\\u202e``-style escapes (so the
    operator sees that they were there); text longer than ``limit`` is cut and ends in ``...``.
    Only the first ``limit`` characters of a long value are looked at, so a 20 MB field costs no
    more than a short one.
    """
    text = _as_text(value)
    # Each escape is at most 10 characters; looking at ``limit`` source characters is enough.
    pieces = [_escape(c) if unicodedata.category(c) in _ESCAPED_CATEGORIES else c for c in text[:limit]]
    if len(text) <= limit and sum(map(len, pieces)) <= limit:
        return "".join(pieces)
    # Cut between pieces, never inside an escape, leaving room for the ellipsis.
    room = max(0, limit - len(_ELLIPSIS))
    kept: list[str] = []
    for piece in pieces:
        if len(piece) > room:
            break
        kept.append(piece)
        room -= len(piece)
    return "".join(kept) + _ELLIPSIS


def clipped(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters (ending in ``...`` when cut), otherwise unchanged.

    For machine-readable output (``--json``): the JSON encoder escapes control characters itself,
    but a device's 20 MB field would still be 20 MB of output.
    """
    if len(value) <= limit:
        return value
    return value[: max(0, limit - len(_ELLIPSIS))] + _ELLIPSIS


def clipped_strings(value: object, limit: int) -> object:
    """``value`` (parsed JSON: dicts, lists, strings, numbers) with every string and key cut by
    :func:`clipped`: the ``--json`` output of a command that prints a device's whole message."""
    if isinstance(value, str):
        return clipped(value, limit)
    if isinstance(value, dict):
        return {clipped(str(k), limit): clipped_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [clipped_strings(v, limit) for v in value]
    return value
