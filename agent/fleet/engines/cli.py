"""``edge-agent fleet engines list``: the engines the controller holds for the fleet, per fingerprint.

Asks the controller (its ``engines`` verb, docs/protocol.md) and prints, per platform fingerprint
(backend and exact version, device, L4T release), each engine's key, size, who built it and when,
how long that build took, and how often other devices downloaded it instead of building.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from agent.fleet.connection import add_broker_arguments, settings_from_args


def add_engines_arguments(sub: Any) -> None:
    """The ``engines`` sub-command of ``fleet`` (``sub``: its sub-parsers)."""
    engines = sub.add_parser(
        "engines", help="the engines the controller holds for the fleet (built once each)"
    )
    verbs = engines.add_subparsers(dest="engines_command", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="per fingerprint: key, size, who built it, when, reuse count")
    listing.add_argument(
        "--json", action="store_true", help="the controller's answer as JSON (docs/fleet.md)"
    )
    listing.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the controller")
    add_broker_arguments(listing)
    listing.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_engines(args: argparse.Namespace) -> int:
    """Run ``fleet engines list``; the exit code."""
    from agent.fleet.controller_client import ControllerClient

    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        listing = client.request("engines", {})
    if args.json:
        print(json.dumps(listing, indent=2, sort_keys=True))
    else:
        print(engines_table(listing))
    return 0


def engines_table(listing: dict[str, Any]) -> str:
    """The listing as text: a heading per fingerprint, a line per engine."""
    state = "on" if listing.get("sharing") else "off" if listing.get("signed") else "off (no signing key)"
    total = int(listing.get("bytes", 0))
    lines = [f"engines: {listing.get('engines', 0)} ({_size(total)}), sharing {state}"]
    for fingerprint, rows in sorted(dict(listing.get("fingerprints", {})).items()):
        lines.append(f"{fingerprint}:")
        lines.append(
            f"  {'KEY':<12}  {'SIZE':>9}  {'BUILT BY':<24}  {'BUILT AT (UTC)':<19}  {'BUILD':>7}  REUSED"
        )
        for row in rows:
            built = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(row["built_at"])))
            seconds = row.get("build_seconds")
            took = f"{float(seconds):.0f}s" if seconds is not None else "-"
            key, size, builder = str(row["key"])[:12], _size(int(row["bytes"])), str(row["built_by"])[:24]
            lines.append(f"  {key:<12}  {size:>9}  {builder:<24}  {built:<19}  {took:>7}  {row['reuse']}")
    return "\n".join(lines)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"
