"""Which devices a fleet command acts on: explicit ``--device`` ids plus what ``--select`` matches.

The selector is checked against each device's retained ``up/info`` (labels, platform facts, agent
version), collected by :func:`agent.fleet.view.status.collect_fleet`. :func:`choose` is pure; the
command prints :meth:`Targets.lines` before it sends anything, and ``--dry-run`` stops there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.errors import UsageError
from agent.fleet.base.untrusted import shown
from agent.fleet.devices.selector import DeviceFacts, Selector, parse_selector
from agent.fleet.view.status import DeviceRow, collect_fleet
from agent.mqtt.settings import MqttSettings

#: Devices named per line of the selection (the count is always printed whole).
_NAMES_SHOWN = 50


@dataclass(frozen=True)
class Targets:
    """The devices a command acts on, and how they were chosen."""

    devices: tuple[str, ...]  # --device ids first (their order), then matches (sorted by id)
    explicit: tuple[str, ...] = ()
    selector: Selector | None = None
    selected: tuple[str, ...] = ()  # devices the selector matched, explicit ones included
    evaluated: int = 0  # devices with a retained up/info the selector was checked against
    without_info: tuple[str, ...] = ()  # devices with a retained status but no parseable info

    def lines(self) -> list[str]:
        """What the operator is shown before anything is sent (device text made safe)."""
        if self.selector is None:
            return [f"selected {len(self.devices)} device(s) by --device: {_names(self.devices)}"]
        lines = [
            f"--select {self.selector}: {len(self.selected)} of {self.evaluated} device(s) with a "
            f"retained up/info match: {_names(self.selected) or '-'}"
        ]
        if self.explicit:
            lines.append(
                f"--device adds: {_names(tuple(d for d in self.explicit if d not in self.selected))}"
            )
        if self.without_info:
            lines.append(
                f"not evaluated (no retained up/info, or it did not parse): {_names(self.without_info)}"
            )
        lines.append(f"selected {len(self.devices)} device(s): {_names(self.devices)}")
        return lines


def _names(devices: Sequence[str]) -> str:
    names = ", ".join(shown(d, 64) for d in devices[:_NAMES_SHOWN])
    return names + (f" (+{len(devices) - _NAMES_SHOWN} more)" if len(devices) > _NAMES_SHOWN else "")


def facts_of(row: DeviceRow) -> DeviceFacts:
    """What a selector is checked against, from one row of ``fleet status``."""
    return DeviceFacts(row.device, row.labels, row.platform, row.agent_version)


def choose(rows: Sequence[DeviceRow], selector: Selector | None, explicit: Sequence[str]) -> Targets:
    """The targets: ``explicit`` ids, then the devices of ``rows`` ``selector`` matches (pure).

    A device without a retained ``up/info`` is never matched: nothing is known about it to match.
    """
    explicit = tuple(dict.fromkeys(explicit))
    if selector is None:
        return Targets(devices=explicit, explicit=explicit)
    known = [r for r in rows if r.info_seen]
    selected = tuple(r.device for r in known if selector.matches(facts_of(r)))
    return Targets(
        devices=tuple(dict.fromkeys(explicit + selected)),
        explicit=explicit,
        selector=selector,
        selected=selected,
        evaluated=len(known),
        without_info=tuple(r.device for r in rows if not r.info_seen),
    )


def resolve_targets(
    settings: MqttSettings,
    select: str | None,
    explicit: Sequence[str],
    *,
    wait_s: float = 5.0,
    read_fleet: Callable[[], Sequence[DeviceRow]] | None = None,
) -> Targets:
    """Parse ``select`` (UsageError naming the column), collect the fleet's retained info, choose.

    ``read_fleet`` collects it when given (a caller that needs the rows again reads them once).

    Raises UsageError when neither ``--device`` nor ``--select`` names a device, or the selection is
    empty; TransportError when the broker cannot be reached.
    """
    if select is None:
        if not explicit:
            raise UsageError(
                "name the devices: --device ID (repeat, or comma-separated) or --select SELECTOR"
            )
        return choose((), None, explicit)
    selector = parse_selector(select)  # before connecting: a typo is reported at once
    rows = read_fleet() if read_fleet is not None else collect_fleet(settings, max_wait_s=wait_s)
    targets = choose(rows, selector, explicit)
    if not targets.devices:
        message = (
            f"--select {selector}: no device matches ({targets.evaluated} device(s) with a retained "
            "up/info under this prefix); nothing sent"
        )
        raise UsageError(message, [message, *targets.lines()[1:]])
    return targets
