"""The controller's engines and build claims as Prometheus series (``/metrics``).

The figures come from the controller's engine desk as plain values (:class:`EngineFigures`: the
controller fills it, this room does not read ``engines/``). Every label is of a fixed, small set:
no key, no device.

- ``edge_engines_stored`` and ``edge_engines_stored_bytes``: the engines held for the fleet;
- ``edge_engines_withdrawn``: the withdrawn engines remembered (never taken again);
- ``edge_engine_claims``: build claims held now; ``edge_engine_claim_oldest_age_seconds``: how long
  the oldest has been held (0 with none); ``edge_engine_claim_waiting_devices``: devices waiting
  for a claimed build, all claims together;
- ``edge_engine_claims_ended_total{why}``: claims ended since the controller started, by why
  (``stored``, ``released`` by its holder, ``expired`` (its holder quiet), ``job_ended`` (its job
  ended without ACTIVE, or ACTIVE without offering), ``operator`` (``fleet engines release``)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.fleet.metrics.text import FamilyHead, labels_text

#: The ``why`` values of ``edge_engine_claims_ended_total``, in the order written.
ENDED_WHY = ("stored", "released", "expired", "job_ended", "operator")


@dataclass(frozen=True)
class EngineFigures:
    """What the engine desk holds now (the controller reads it at each scrape)."""

    stored: int
    stored_bytes: int
    withdrawn: int
    claims: int
    oldest_claim_age_s: float
    waiting: int
    ended: Mapping[str, int] = field(default_factory=dict)


#: ``engines()``: the desk's figures now.
EnginesFn = Callable[[], EngineFigures]

STORED = FamilyHead("edge_engines_stored", "gauge", "Engines the controller holds for the fleet.")
STORED_BYTES = FamilyHead("edge_engines_stored_bytes", "gauge", "Bytes of the engines the controller holds.")
WITHDRAWN = FamilyHead(
    "edge_engines_withdrawn", "gauge", "Withdrawn engines the controller remembers (never taken again)."
)
CLAIMS = FamilyHead("edge_engine_claims", "gauge", "Build claims held now (a device builds a key for all).")
OLDEST = FamilyHead(
    "edge_engine_claim_oldest_age_seconds",
    "gauge",
    "How long the oldest build claim has been held (0: none).",
)
WAITING = FamilyHead(
    "edge_engine_claim_waiting_devices", "gauge", "Devices waiting for a claimed build, all claims together."
)
ENDED = FamilyHead(
    "edge_engine_claims_ended_total",
    "counter",
    "Build claims ended since the controller started, by why: stored, released, expired, job_ended,"
    " operator.",
)


def engine_lines(figures: EngineFigures) -> str:
    """The series of :class:`EngineFigures` as exposition text."""
    parts = []
    for head, value in (
        (STORED, figures.stored),
        (STORED_BYTES, figures.stored_bytes),
        (WITHDRAWN, figures.withdrawn),
        (CLAIMS, figures.claims),
        (OLDEST, round(figures.oldest_claim_age_s, 1)),
        (WAITING, figures.waiting),
    ):
        parts += [head.header(), head.line("", float(value))]
    parts.append(ENDED.header())
    parts += [ENDED.line(labels_text([("why", why)]), float(figures.ended.get(why, 0))) for why in ENDED_WHY]
    return "".join(parts)
