"""What several fleet commands take alike: the target devices (``--device``, ``--select``,
``--dry-run``) and JSON arguments validated against a model, each mistake naming its flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from pydantic import BaseModel, ValidationError

from agent.errors import UsageError
from agent.flag_aliases import add_alias
from agent.fleet.cli.connection import settings_from_args

if TYPE_CHECKING:
    from agent.fleet.devices.targets import Targets
    from agent.fleet.view.status import DeviceRow

SpecT = TypeVar("SpecT", bound=BaseModel)


def add_target_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """``--device``, ``--select`` and ``--dry-run``: which devices a command acts on (docs/fleet.md)."""
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        dest="device_list" if positional else "device",
        help="target device id (repeat, or comma-separated)" + (", besides DEVICE" if positional else ""),
    )
    parser.add_argument(
        "--select",
        default=None,
        metavar="SELECTOR",
        help="also every device whose retained up/info matches, e.g. 'site=berlin-3,platform.dla_cores>=1'",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show the selected devices and stop: nothing is sent"
    )
    add_retained_wait(parser, old="--select-wait", what="the retained up/info --select is checked against")


#: ``--retained-wait`` default: how long to collect the broker's retained messages.
DEFAULT_RETAINED_WAIT_S = 5.0


def add_retained_wait(parser: argparse.ArgumentParser, *, old: str, what: str) -> None:
    """``--retained-wait SECONDS``, and ``old`` (``--select-wait``, ``fleet status --wait``: its
    names before docs/cli.md's one scheme) as a hidden alias."""
    action = parser.add_argument(
        "--retained-wait",
        type=float,
        default=DEFAULT_RETAINED_WAIT_S,
        metavar="SECONDS",
        help=f"longest time to collect {what}",
    )
    add_alias(parser, old, action)


class FleetRead:
    """The fleet's retained ``up/status`` and ``up/info``, collected from the broker the first time
    they are asked for and kept: a command that selects devices and looks up their slot reads once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._rows: list[DeviceRow] | None = None

    def __call__(self) -> list[DeviceRow]:
        if self._rows is None:
            from agent.fleet.view.status import collect_fleet

            self._rows = collect_fleet(settings_from_args(self._args), max_wait_s=self._args.retained_wait)
        return self._rows


def chosen_targets(
    args: argparse.Namespace,
    explicit: list[str],
    *,
    out: TextIO | None = None,
    fleet: FleetRead | None = None,
) -> Targets | None:
    """The devices ``args`` name, printed to ``out`` (stdout; stderr where stdout carries JSON); None
    when ``--dry-run`` says to stop there. ``--select`` reads the fleet through ``fleet``."""
    from agent.fleet.deploy.plan import parse_devices
    from agent.fleet.devices.targets import resolve_targets

    targets = resolve_targets(
        settings_from_args(args),
        args.select,
        parse_devices(explicit),
        wait_s=args.retained_wait,
        read_fleet=fleet or FleetRead(args),
    )
    for line in targets.lines():
        print(f"{args.fleet_command}: {line}", file=out or sys.stdout)
    if args.dry_run:
        print(f"{args.fleet_command}: --dry-run: nothing sent", file=out or sys.stdout)
        return None
    return targets


def spec_arg(model: type[SpecT], value: str | None, flag: str) -> SpecT | None:
    """``value`` (JSON or @file) validated as ``model``; a UsageError naming ``flag`` when it is not."""
    if value is None:
        return None
    try:
        return model.model_validate(json_arg(value, flag))
    except ValidationError as exc:
        raise UsageError(f"invalid {flag}", validation_problems(exc, flag)) from exc


def json_arg(value: str, flag: str) -> Any:
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"{flag}: cannot read {value[1:]}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: not valid JSON ({exc})") from exc


def validation_problems(exc: ValidationError, flag: str) -> list[str]:
    return [
        f"{flag} {'.'.join(str(p) for p in e['loc']) or '(value)'}: {e['msg']}"
        for e in exc.errors(include_url=False)
    ]


def keep_slot_model_id(
    args: argparse.Namespace,
    fields: dict[str, Any],
    devices: Sequence[str],
    *,
    out: TextIO | None = None,
    fleet: FleetRead | None = None,
) -> None:
    """Without ``--model-id``: the id the targets' slot serves now, read from their retained up/info
    (:mod:`agent.fleet.deploy.slot_model`); the file's stem only for an empty slot. Says which, on ``out``."""
    if fields.get("model_id") is not None:
        return
    from agent.fleet.deploy.slot_model import default_model_id, slot_model_ids

    rows = (fleet or FleetRead(args))()
    model_id, line = default_model_id(slot_model_ids(rows, devices, args.slot), args.model.stem, args.slot)
    fields["model_id"] = model_id
    print(f"{args.fleet_command}: {line}", file=out or sys.stdout)
