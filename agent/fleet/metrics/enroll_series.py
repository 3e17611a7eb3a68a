"""The controller's enrollment desk as Prometheus series (``/metrics``).

The figures come from the desk as plain values (:class:`EnrollFigures`); every label is of a small
set fixed in the code (an outcome, a refusal code), never a device's words.

- ``edge_enroll_replies_total{outcome}``: replies since start: ``issued``, ``pending``, ``rejected``,
  ``refused``, and ``renewed`` (renewals issued, also counted as issued);
- ``edge_enroll_refused_total{code}``: refusals since start by code (docs/enrollment.md);
- ``edge_enroll_dropped_total``: requests dropped unread (the desk's queue full, or no id to answer);
- ``edge_enroll_pending``: devices waiting for an operator; ``edge_enroll_enrolled``: enrolled devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.fleet.metrics.text import FamilyHead, labels_text

#: The outcomes always written (0 before the first), in this order.
OUTCOMES = ("issued", "pending", "rejected", "refused", "renewed")


@dataclass(frozen=True)
class EnrollFigures:
    """What the enrollment desk counted and holds now (read at each scrape)."""

    pending: int
    enrolled: int
    dropped: int
    outcomes: Mapping[str, int] = field(default_factory=dict)
    refusals: Mapping[str, int] = field(default_factory=dict)


#: ``enrollment()``: the desk's figures now.
EnrollFn = Callable[[], EnrollFigures]

REPLIES = FamilyHead(
    "edge_enroll_replies_total",
    "counter",
    "Enrollment and renewal replies since the controller started, by outcome (renewed: renewals issued).",
)
REFUSED = FamilyHead(
    "edge_enroll_refused_total", "counter", "Enrollment and renewal requests refused since start, by code."
)
DROPPED = FamilyHead(
    "edge_enroll_dropped_total",
    "counter",
    "Enrollment requests dropped unread since start (the desk's queue full, or nobody to answer).",
)
PENDING = FamilyHead("edge_enroll_pending", "gauge", "Devices waiting for an operator to accept them.")
ENROLLED = FamilyHead("edge_enroll_enrolled", "gauge", "Devices holding a certificate the desk issued.")


def enroll_lines(figures: EnrollFigures) -> str:
    """The series of :class:`EnrollFigures` as exposition text."""
    parts = [REPLIES.header()]
    parts += [
        REPLIES.line(labels_text([("outcome", o)]), float(figures.outcomes.get(o, 0))) for o in OUTCOMES
    ]
    parts.append(REFUSED.header())
    parts += [
        REFUSED.line(labels_text([("code", code)]), float(n)) for code, n in sorted(figures.refusals.items())
    ]
    for head, value in ((DROPPED, figures.dropped), (PENDING, figures.pending), (ENROLLED, figures.enrolled)):
        parts += [head.header(), head.line("", float(value))]
    return "".join(parts)
