"""Every device's ``/metrics`` lines, kept between scrapes as bytes: one row per device.

A row holds a device's text per family, in the fleet's order of families (the per-device families
of :data:`~agent.fleet.metrics.device_series.DEVICE_FAMILIES`, then each telemetry family as it was
first seen). A scrape puts a family's lines together by transposing the rows (one ``zip``) and
joining bytes: nothing is formatted, looked up or encoded per device at a scrape. A device is
rendered again only when :meth:`FleetView.changes` says it moved; new telemetry redoes its
telemetry lines only (:mod:`agent.fleet.metrics.figure_lines`).

The caller holds one lock around every method (:class:`agent.fleet.metrics.exposition.FleetMetrics`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest

from agent.fleet.metrics.device_series import (
    DEVICE_FAMILIES,
    INFO,
    LAST_TELEMETRY,
    device_label,
    device_lines,
    label_name,
    label_value,
)
from agent.fleet.metrics.figure_lines import LAYOUTS_LIMIT, FigureLayout, figure_text, layout_of
from agent.fleet.metrics.text import FamilyHead, as_bytes, escape, labels_text
from agent.fleet.view.live import FleetView

#: Device label keys exported on ``edge_device_info`` (the most used first; a fleet with more keys
#: than this has them in the console and in selectors, not in Prometheus).
MAX_LABEL_KEYS = 32

Mark = tuple[int, int, bool]  # FleetView.changes()' entry for a device

_DEVICE_SLOTS = {head.name: i for i, head in enumerate(DEVICE_FAMILIES)}
_INFO = _DEVICE_SLOTS[INFO.name]
_LAST = _DEVICE_SLOTS[LAST_TELEMETRY.name]
_NDEV = len(DEVICE_FAMILIES)


@dataclass
class KeptDevice:
    """What is kept of one device between scrapes: its row and what its info line is made of."""

    mark: Mark  # FleetView.changes()' entry when rendered
    dev: str  # its device label, escaped
    state: str
    labels: dict[str, str]
    agent_version: str | None
    row: tuple[bytes, ...]  # its text per family, in KeptFleet's order of families (shorter: b"")
    telemetry_redone: float = -math.inf  # KeptFleet's clock when new telemetry alone last redid it


def info_names(counts: dict[str, int]) -> tuple[tuple[str, str], ...]:
    """(label name, label key) of the device labels on ``edge_device_info``: the MAX_LABEL_KEYS keys
    most devices have (ties by key), by key; two keys that map to one name: the first wins."""
    top = sorted(counts, key=lambda key: (-counts[key], key))[:MAX_LABEL_KEYS]
    names: dict[str, str] = {}
    for key in sorted(top):
        names.setdefault(label_name(key), key)
    return tuple(names.items())


class KeptFleet:
    """The rows of every device the fleet view holds (see the module docstring)."""

    def __init__(self, view: FleetView, clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.clock = clock
        self.devices: dict[str, KeptDevice] = {}
        self.rendered = 0  # devices whose lines were redone (telemetry or all), for tests
        self._families: list[FamilyHead] = list(DEVICE_FAMILIES)
        self._headers: list[bytes] = [as_bytes(head.header()) for head in DEVICE_FAMILIES]
        self._telemetry_slots: dict[str, int] = {}
        self._layout_slots: dict[FigureLayout, tuple[int, ...] | None] = {}
        self._order: list[str] = []
        self._order_moved = False
        self._label_counts: dict[str, int] = {}
        self._labels_moved = False
        self._info_names: tuple[tuple[str, str], ...] = ()

    def forget_gone(self, changes: dict[str, Mark]) -> bool:
        """Drop the devices the view no longer holds; True when there were some."""
        gone = [device_id for device_id in self.devices if device_id not in changes]
        for device_id in gone:
            self._count_labels(self.devices.pop(device_id).labels, None)
        self._order_moved = self._order_moved or bool(gone)
        return bool(gone)

    def pending(self, changes: dict[str, Mark]) -> list[tuple[str, Mark]]:
        """The devices whose lines are not those of their mark in ``changes`` (new ones included)."""
        devices = self.devices
        return [
            (d, mark) for d, mark in changes.items() if (kept := devices.get(d)) is None or kept.mark != mark
        ]

    def render(
        self, device_id: str, mark: Mark, *, older_only: bool = False, telemetry_every_s: float = 0.0
    ) -> bool:
        """Redo one device's lines as of ``mark``: its telemetry lines when only they moved, else all.
        False when nothing was redone: the view forgot the device since; or ``older_only`` and the
        kept lines are of a later change than ``mark`` (a scrape rendered it in the meantime); or
        only its telemetry moved and new telemetry redid it less than ``telemetry_every_s`` ago."""
        kept = self.devices.get(device_id)
        if kept is not None and (kept.mark == mark or (older_only and kept.mark[0] > mark[0])):
            return False
        if kept is not None and kept.mark[1:] == mark[1:]:  # new telemetry figures, nothing else
            now = self.clock()
            if now - kept.telemetry_redone < telemetry_every_s:
                return False
        if kept is not None and kept.mark[1:] == mark[1:]:  # new telemetry figures, nothing else
            got = self.view.telemetry(device_id)
            if got is None:  # forgotten since changes() (it goes at the next refresh)
                return False
            kept.row = self._with_telemetry(kept.row[:_NDEV], *got, mark[2], kept.dev)
            kept.mark, kept.telemetry_redone = mark, now
        else:
            state = self.view.device(device_id)
            if state is None:
                return False
            dev = escape(device_label(device_id))
            lines = [b""] * _NDEV
            for name, text in device_lines(state, dev).items():
                lines[_DEVICE_SLOTS[name]] = as_bytes(text)
            lines[_INFO] = self._info_line(device_id, state.labels, state.agent_version)
            row = self._with_telemetry(tuple(lines), state.telemetry, state.telemetry_at, state.stale, dev)
            self._count_labels(None if kept is None else kept.labels, state.labels)
            self._order_moved = self._order_moved or kept is None
            self.devices[device_id] = KeptDevice(
                mark, dev, state.state, state.labels, state.agent_version, row
            )
        self.rendered += 1
        return True

    def settle(self) -> None:
        """Bring the device order and the info lines' label names up to date (:meth:`lines` does it
        too; the warm pass does it beforehand, so a scrape need not)."""
        if self._labels_moved:
            self._relabel()
        if self._order_moved:
            self._order, self._order_moved = sorted(self.devices), False

    def lines(self) -> list[bytes]:
        """The per-device families, headers and lines, devices by id, telemetry families by name
        (each only when some device has lines in it), as pieces to join."""
        self.settle()
        devices = self.devices
        columns = list(zip_longest(*[devices[d].row for d in self._order], fillvalue=b""))
        parts: list[bytes] = []
        for slot in range(_NDEV):
            parts.append(self._headers[slot])
            if slot < len(columns):
                parts += columns[slot]
        for slot in sorted(range(_NDEV, len(self._families)), key=lambda s: self._families[s].name):
            if slot < len(columns) and any(columns[slot]):
                parts.append(self._headers[slot])
                parts += columns[slot]
        return parts

    def states(self) -> Counter[str]:
        """Devices by state (online, offline, unknown)."""
        return Counter(kept.state for kept in self.devices.values())

    def _with_telemetry(
        self, lines: tuple[bytes, ...], figures: dict[str, float], at: float | None, stale: bool, dev: str
    ) -> tuple[bytes, ...]:
        """A row: a device's own ``lines`` (its first _NDEV families), its last telemetry time ``at``
        and its telemetry lines (none while it is stale)."""
        last = b"" if at is None else as_bytes(LAST_TELEMETRY.line(f'device="{dev}"', at))
        own = (*lines[:_LAST], last, *lines[_LAST + 1 :])
        if stale:
            return own
        layout = layout_of(tuple(figures))
        text = figure_text(layout, figures, dev)
        slots = self._slots(layout)
        if slots is None:  # its families are the fleet's first ones, in order: the usual case
            return own + tuple(text)
        row = [*own, *[b""] * (len(self._families) - _NDEV)]
        for slot, family in zip(slots, text, strict=True):
            row[slot] = family
        return tuple(row)

    def _slots(self, layout: FigureLayout) -> tuple[int, ...] | None:
        """Where each family of ``layout`` goes in a row; None when they follow the device's own
        families in order."""
        try:
            return self._layout_slots[layout]
        except KeyError:
            pass
        for head in layout.heads:
            if head.name not in self._telemetry_slots:
                self._telemetry_slots[head.name] = len(self._families)
                self._families.append(head)
                self._headers.append(as_bytes(head.header()))
        slots = tuple(self._telemetry_slots[head.name] for head in layout.heads)
        found = None if slots == tuple(range(_NDEV, _NDEV + len(slots))) else slots
        if len(self._layout_slots) >= LAYOUTS_LIMIT:
            self._layout_slots.clear()
        self._layout_slots[layout] = found
        return found

    def _info_line(self, device_id: str, labels: dict[str, str], agent_version: str | None) -> bytes:
        pairs = [("device", device_label(device_id)), ("agent_version", label_value(agent_version))]
        pairs += [(name, label_value(labels.get(key))) for name, key in self._info_names]
        return as_bytes(INFO.line(labels_text(pairs), 1.0))

    def _count_labels(self, old: dict[str, str] | None, new: dict[str, str] | None) -> None:
        """Keep the fleet's count of devices per label key (the info line's label names)."""
        if (old or {}).keys() == (new or {}).keys():
            return
        counts = self._label_counts
        for key in old or ():
            counts[key] -= 1
            if not counts[key]:
                del counts[key]
        for key in new or ():
            counts[key] = counts.get(key, 0) + 1
        self._labels_moved = True

    def _relabel(self) -> None:
        """The info lines again, when the fleet's label keys changed what they are named after."""
        self._labels_moved = False
        names = info_names(self._label_counts)
        if names == self._info_names:
            return
        self._info_names = names
        for device_id, kept in self.devices.items():
            row = list(kept.row)
            row[_INFO] = self._info_line(device_id, kept.labels, kept.agent_version)
            kept.row = tuple(row)
