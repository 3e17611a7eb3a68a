"""A device's telemetry figures as sample lines on the controller's ``/metrics``.

A device sends the same figure names message after message, and most devices of a fleet send the
same names, so what a set of names becomes (each figure's family, its labels after ``device``, its
scale; a series that repeats after cutting, written once) is worked out once per set of names, a
:class:`FigureLayout`: one ``str.format`` template for all of a device's telemetry lines, its
families apart by a NUL. A message then costs one ``format``, one ``encode`` and one ``split``, not
a formatted line per figure: this runs for every telemetry message the controller renders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from agent.fleet.metrics.text import FamilyHead, as_bytes, labels_text, number
from agent.telemetry.series import series_of

#: Layouts kept, by their figure names (a fleet has a handful; a device inventing names each
#: message makes one each, so the cache starts over when full).
LAYOUTS_LIMIT = 1_000
#: Between two families in a layout's template; a layout whose text holds one renders line by line.
_APART = "\x00"


@dataclass(frozen=True)
class FigureLine:
    """One series of a layout: the figure it reads, the text around the device label and the
    value (``edge_x{device="`` ... ``",stream="cam0"} ``), and the figure's scale."""

    figure: str
    before: str
    after: str
    scale: float


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: KeptFleet keys its slots on it
class FigureLayout:
    """What one set of figure names becomes: its families (first seen first) and their series, and
    the template that writes them all at once (None: a label holds a NUL, written line by line)."""

    heads: tuple[FamilyHead, ...]
    lines: tuple[tuple[FigureLine, ...], ...]  # per family
    values: Callable[[dict[str, float]], Any]  # the figures' values, in the template's order
    scaled: tuple[tuple[int, float], ...]  # (place in values, scale) of those not scaled by 1
    template: str | None


_LAYOUTS: dict[tuple[str, ...], FigureLayout] = {}


def _braced(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _getter(names: list[str]) -> Callable[[dict[str, float]], Any]:
    """A function of figures to the values of ``names``, a tuple (itemgetter's, quick, for 2 and more)."""
    if len(names) > 1:
        return itemgetter(*names)
    return lambda figures: tuple(figures[name] for name in names)


def layout_of(names: tuple[str, ...]) -> FigureLayout:
    """The layout of figures named ``names`` (in the message's order); names no rule knows are left out."""
    found = _LAYOUTS.get(names)
    if found is not None:
        return found
    by_family: dict[str, tuple[FamilyHead, list[FigureLine]]] = {}
    seen: set[tuple[str, str]] = set()
    for name in names:
        series = series_of(name)
        if series is None:
            continue
        rest = labels_text(series.labels)
        if (series.metric, rest) in seen:  # cut label values made two figures one series
            continue
        seen.add((series.metric, rest))
        head = FamilyHead(series.metric, series.kind, series.help)
        after = f'",{rest}}} ' if rest else '"} '
        line = FigureLine(name, f'{series.metric}{{device="', after, series.scale)
        by_family.setdefault(series.metric, (head, []))[1].append(line)
    lines = tuple(tuple(family) for _, family in by_family.values())
    ordered = [line for family in lines for line in family]
    # {0} is the device label, {k} the k-th value (a float, whose repr is number()'s text for it)
    families, k = [], 0
    for family in lines:
        text = ""
        for line in family:
            k += 1
            text += f"{_braced(line.before)}{{0}}{_braced(line.after)}{{{k}!r}}\n"
        families.append(text)
    layout = FigureLayout(
        tuple(head for head, _ in by_family.values()),
        lines,
        _getter([line.figure for line in ordered]),
        tuple((i, line.scale) for i, line in enumerate(ordered) if line.scale != 1.0),
        None if any(_APART in text for text in families) else _APART.join(families),
    )
    if len(_LAYOUTS) >= LAYOUTS_LIMIT:
        _LAYOUTS.clear()
    _LAYOUTS[names] = layout
    return layout


def figure_text(layout: FigureLayout, figures: dict[str, float], dev: str) -> list[bytes]:
    """One device's telemetry lines, UTF-8, per family of ``layout`` (``dev``: its escaped device
    label; ``figures`` holds every name of the layout)."""
    if not layout.heads:
        return []
    values = layout.values(figures)
    if layout.scaled:
        values = list(values)
        for place, scale in layout.scaled:
            values[place] *= scale
    total = sum(values)
    if layout.template is None or total - total != 0.0 or _APART in dev:  # NaN, ±Inf: number()'s names
        return [as_bytes(text) for text in _line_by_line(layout, figures, dev)]
    return as_bytes(layout.template.format(dev, *values)).split(_APART.encode())


def _line_by_line(layout: FigureLayout, figures: dict[str, float], dev: str) -> list[str]:
    return [
        "".join(
            f"{line.before}{dev}{line.after}{number(figures[line.figure] * line.scale)}\n" for line in family
        )
        for family in layout.lines
    ]
