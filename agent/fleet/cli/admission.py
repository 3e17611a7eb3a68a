"""``edge-agent fleet devices register|pending|accept|reject|enrolled``: the operator's side of
enrollment, answered by the controller's enrollment desk (docs/enrollment.md).

Each is one controller request (``devices_{verb}``); ``--json`` prints the controller's answer as
is, otherwise a line or a table. A refusal exits 1 with its code (``not_pending``,
``reenroll_needed``, ``claim_used_up``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent.fleet.cli.connection import add_broker_arguments, settings_from_args

#: The verbs of ``fleet devices`` this module answers.
ADMISSION_VERBS = ("register", "pending", "accept", "reject", "enrolled")


def add_admission_arguments(verbs: Any) -> None:
    """Add the admission verbs to ``verbs``, the sub-parsers of ``fleet devices``."""
    register = verbs.add_parser(
        "register", help="admit a device at once when it enrolls: by id, by hardware serial, or both"
    )
    register.add_argument("device_id", nargs="?", default=None, metavar="ID", help="the device id")
    register.add_argument(
        "--serial", default=None, help="its hardware serial (with ID: the request must name it)"
    )
    verbs.add_parser("pending", help="devices waiting for an operator, oldest first")
    accept = verbs.add_parser("accept", help="issue a waiting device's certificate")
    accept.add_argument("device_id", metavar="ID")
    accept.add_argument(
        "--reenroll",
        action="store_true",
        help="the device is enrolled with another key (a factory reset): revoke the old certificate",
    )
    reject = verbs.add_parser("reject", help="refuse a device: its requests are answered 'rejected'")
    reject.add_argument("device_id", metavar="ID")
    reject.add_argument("--reason", default="", help="one line the device is told")
    verbs.add_parser("enrolled", help="enrolled devices with their certificates' serials and expiry")
    for verb in ADMISSION_VERBS:
        parser = verbs.choices[verb]
        parser.add_argument("--json", action="store_true", help="the controller's answer as JSON")
        parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the controller")
        add_broker_arguments(parser)
        parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_admission(args: argparse.Namespace) -> int:
    """Send ``fleet devices VERB`` to the controller and print its answer; the exit code."""
    from agent.fleet.controller.client import ControllerClient, RequestRefusedError

    verb = args.devices_command
    body: dict[str, Any] = {}
    if verb in ("register", "accept", "reject"):
        body["device_id"] = args.device_id
    if verb == "register":
        body["serial"] = args.serial
    if verb == "accept":
        body["reenroll"] = args.reenroll
    if verb == "reject":
        body["reason"] = args.reason
    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        try:
            result = client.request(f"devices_{verb}", body)
        except RequestRefusedError as exc:
            if args.json:
                print(json.dumps({"ok": False, "error_code": exc.code, "error": exc.reason}, indent=2))
            else:
                print(f"error: {exc.reason} ({exc.code})", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else admission_text(verb, result))
    return 0


def admission_text(verb: str, result: dict[str, Any]) -> str:
    """The answer to ``fleet devices VERB`` as an operator reads it."""
    if verb == "pending":
        rows = [
            f"{p['device_id']:<24} {p['claim']:<16} {p['serial'] or '-':<16} {p['asks']:>5} "
            f"{_age(p['first_at']):>8}  {_notes(p)}"
            for p in result["pending"]
        ]
        head = f"{'DEVICE':<24} {'CLAIM':<16} {'SERIAL':<16} {'ASKS':>5} {'WAITING':>8}"
        return "\n".join([head, *rows]) if rows else "no device waits"
    if verb == "enrolled":
        rows = [
            f"{e['device_id']:<24} {e['serial']:<40} {_days(e['not_after']):>6.1f}"
            for e in result["enrolled"]
        ]
        head = f"{'DEVICE':<24} {'SERIAL':<40} {'DAYS':>6}"
        return "\n".join([head, *rows]) if rows else "no device enrolled"
    if verb == "accept":
        if result["already"]:
            return f"{result['device_id']} was accepted already (certificate {result['serial']})"
        return (
            f"{result['device_id']} accepted: certificate {result['serial']}, "
            f"{_days(result['not_after']):.0f} days"
        )
    if verb == "reject":
        return f"{result['device_id']} rejected" + (" (it was pending)" if result["was_pending"] else "")
    who = " ".join(filter(None, [result["device_id"], result["serial"] and f"serial {result['serial']}"]))
    return f"registered {who}: admitted at once when it enrolls"


def _notes(pending: dict[str, Any]) -> str:
    notes = ["re-enroll"] if pending["reenroll"] else []
    if pending["contested"]:
        notes.append(f"{pending['contested']} request(s) with another key")
    return ", ".join(notes)


def _age(at: float) -> str:
    seconds = max(0.0, time.time() - at)
    return f"{seconds / 3600:.1f}h" if seconds >= 3600 else f"{seconds / 60:.0f}m"


def _days(not_after: float) -> float:
    return (not_after - time.time()) / 86400
