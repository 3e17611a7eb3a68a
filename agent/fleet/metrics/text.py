"""Prometheus' text exposition format (version 0.0.4), written directly: headers, sample lines, escaping.

The controller's ``/metrics`` keeps each device's lines rendered between scrapes
(:mod:`agent.fleet.metrics.exposition`), which ``prometheus_client``'s collectors cannot: they format every
sample at every scrape, and formatting was most of a 10,000-device scrape's time. The output is the
format ``prometheus_client`` writes for the same families (a counter's name ends in ``_total``, an
info metric is a gauge named ``..._info`` with the value 1), so series names do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: The Content-Type of the format (what Prometheus expects of a text scrape).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Kind = Literal["gauge", "counter"]


def escape(value: str) -> str:
    """A label value as it stands between the quotes."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value  # the usual case, and the one a scrape of 10,000 devices meets 100,000 times


def as_bytes(text: str) -> bytes:
    """UTF-8; a lone surrogate becomes ``?`` (the protocol's JSON parser refuses one, but a scrape
    must not fail)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def number(value: float) -> str:
    """A sample value: Python's shortest round-trip form, which Prometheus' parser reads exactly
    (``1795632518.4576313``, ``918000000.0``, ``1e+16``), and its names for the non-finite ones."""
    value = float(value)
    if value - value == 0.0:  # finite (inf - inf and nan - nan are nan)
        return repr(value)
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def labels_text(pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
    """``name="value",...`` (escaped values), without the braces."""
    return ",".join([f'{name}="{escape(value)}"' for name, value in pairs])


@dataclass(frozen=True)
class FamilyHead:
    """One metric family: its sample name (a counter's ends in ``_total``), kind and help."""

    name: str
    kind: Kind
    help: str

    def header(self) -> str:
        """The ``# HELP`` and ``# TYPE`` lines."""
        text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {self.name} {text}\n# TYPE {self.name} {self.kind}\n"

    def line(self, labels: str, value: float) -> str:
        """One sample line; ``labels`` as :func:`labels_text` makes them."""
        if not labels:
            return f"{self.name} {number(value)}\n"
        return f"{self.name}{{{labels}}} {number(value)}\n"
