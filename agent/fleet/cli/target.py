"""``edge-agent fleet config get|diff|set`` and ``edge-agent fleet agent release``: the device's own
targets (its configuration overlay, the agent release it runs) from the operator's side.

``config set`` checks the overlay's keys, seals every ``--secret KEY=@FILE`` to the device's key
(the file is read, sealed and forgotten: only the sealed string is uploaded, kept or sent), signs a
release when given the release key, and starts a one-device rollout of target ``_config`` on the
controller; ``fleet rollout start --config`` rolls one overlay out to many devices in waves.
docs/fleet.md, "The device's own configuration and agent".
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.errors import UsageError
from agent.fleet.cli.connection import add_broker_arguments, settings_from_args
from agent.fleet.deploy.target_document import TargetDocument


def add_config_arguments(sub: Any) -> None:
    """``fleet config get|diff|set``."""
    config = sub.add_parser("config", help="a device's configuration overlay: get, diff, set")
    verbs = config.add_subparsers(dest="config_command", required=True, metavar="VERB")

    get = verbs.add_parser("get", help="the overlay desired for DEVICE and what it reports running")
    get.add_argument("device", metavar="DEVICE", help="the device id")
    get.add_argument("--json", action="store_true", help="machine-readable output")
    _common(get)

    diff = verbs.add_parser(
        "diff", help="what OVERLAY.yaml changes against DEVICE's desired overlay, key by key"
    )
    diff.add_argument("device", metavar="DEVICE", help="the device id")
    diff.add_argument("overlay", type=Path, metavar="OVERLAY.yaml", help="the new overlay")
    _common(diff)

    put = verbs.add_parser(
        "set",
        help="seal secrets to DEVICE's key, sign, and roll OVERLAY.yaml out to DEVICE through the controller",
    )
    put.add_argument("device", metavar="DEVICE", help="the device id")
    put.add_argument("overlay", type=Path, metavar="OVERLAY.yaml", help="the overlay (agent.yaml keys)")
    put.add_argument(
        "--version", required=True, help="the overlay's version: what the device reports running"
    )
    put.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="KEY=@FILE",
        help="seal FILE's bytes to the device's key as dotted KEY (streams.door.password); repeat",
    )
    put.add_argument(
        "--device-cert",
        type=Path,
        default=None,
        metavar="CERT.pem",
        help="the device's certificate, whose key a --secret is sealed to (default with --ca-dir: "
        "the one the CA's ledger keeps)",
    )
    put.add_argument(
        "--ca-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the controller's CA directory: the device's current certificate is taken from its ledger "
        "(a --device-cert's key must be one it issued DEVICE, unrevoked)",
    )
    put.add_argument(
        "--release-key",
        type=Path,
        action="append",
        default=[],
        metavar="KEY",
        help="sign the overlay with this release key (a fleet root needs it; repeat for a threshold)",
    )
    put.add_argument(
        "--probation-s",
        type=float,
        default=None,
        help="seconds the device watches the new configuration (default 60)",
    )
    put.add_argument("--wait", action="store_true", help="follow the rollout until it ends")
    put.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
    _common(put)


def add_agent_arguments(sub: Any) -> None:
    """``fleet agent release``."""
    agent = sub.add_parser("agent", help="agent releases: the document naming a directory of wheels")
    verbs = agent.add_subparsers(dest="agent_command", required=True, metavar="VERB")
    release = verbs.add_parser(
        "release", help="write WHEEL_DIR/agent-release.json: every wheel's name, size and SHA-256 (offline)"
    )
    release.add_argument(
        "wheel_dir", type=Path, metavar="WHEEL_DIR", help="the release's wheels (pip wheel -w)"
    )
    release.add_argument("--version", required=True, help="the agent's version (PEP 440)")
    release.add_argument(
        "--python", default=None, help="the Python minor version, e.g. 3.10 (default: the wheels' cpXY tags)"
    )
    release.add_argument(
        "--platform",
        action="append",
        default=None,
        metavar="MACHINE",
        help="a machine it runs on, aarch64 or x86_64 (repeat; default: the wheels' platform tags)",
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the controller's answer"
    )
    parser.add_argument(
        "--retained-wait",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="longest time to read the retained state",
    )
    add_broker_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_agent(args: argparse.Namespace) -> int:
    """``fleet agent release``: the release document written beside the wheels."""
    from agent.fleet.deploy.agent_release import make_release, write_release

    if not args.wheel_dir.is_dir():
        raise UsageError(f"WHEEL_DIR: {args.wheel_dir} is not a directory")
    release = make_release(args.wheel_dir, version=args.version, python=args.python, platforms=args.platform)
    path = write_release(args.wheel_dir, release)
    size = sum(w.size for w in release.wheels)
    print(
        f"agent release {release.version} for Python {release.python} on {', '.join(release.platforms)}: "
        f"{len(release.wheels)} wheels, {size} bytes, in {path}"
    )
    return 0


def run_config(args: argparse.Namespace) -> int:
    """One ``fleet config`` verb; 0 on success."""
    if args.config_command == "get":
        return _get(args)
    if args.config_command == "diff":
        return _diff(args)
    return _set(args)


def _desired_overlay(args: argparse.Namespace) -> tuple[Any, dict[str, Any] | None, str | None]:
    """The device's target state, its desired overlay as held by the controller, and that text."""
    from agent.fleet.controller.client import ControllerClient
    from agent.fleet.deploy.overlay import parse_overlay
    from agent.fleet.devices.target_state import read_target_state
    from agent.protocol.device_targets import CONFIG_TARGET

    settings = settings_from_args(args)
    state = read_target_state(settings, args.device, CONFIG_TARGET, max_wait_s=args.retained_wait)
    if state.desired is None:
        return state, None, None
    with ControllerClient(settings, timeout=args.timeout) as client:
        text = str(client.request("document", {"sha256": state.desired.sha256})["text"])
    return state, parse_overlay(text.encode("utf-8"), f"{args.device}'s desired overlay"), text


def _get(args: argparse.Namespace) -> int:
    from agent.fleet.base.untrusted import shown

    state, _, text = _desired_overlay(args)
    desired = state.desired
    reported = state.reported
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "desired": None
                    if desired is None
                    else {
                        "version": desired.version,
                        "job_id": desired.job_id,
                        "sha256": desired.sha256,
                        "overlay": text,
                    },
                    "reported": None if reported is None else reported.model_dump(mode="json"),
                    "problems": list(state.problems),
                },
                indent=2,
                sort_keys=True,
            )
        )
        return 0
    if desired is None:
        print(f"{args.device}: no configuration overlay desired (it runs its own agent.yaml)")
    else:
        print(
            f"{args.device}: desired configuration {desired.version} "
            f"(job {desired.job_id}, {desired.sha256[:16]})"
        )
    if reported is None:
        print(f"{args.device}: reports no configuration target (an older agent, or no up/info retained)")
    else:
        line = f"{args.device}: runs configuration {shown(reported.version or 'base', 64)}"
        if reported.pending:
            line += f", applying {shown(reported.pending, 64)}"
        print(line)
        if reported.reverted:
            print(f"{args.device}: last one tried was put back: {shown(reported.reverted, 300)}")
    for problem in state.problems:
        print(f"{args.device}: unreadable {problem}")
    if text is not None:
        print(text.rstrip("\n"))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from agent.fleet.deploy.overlay import overlay_changes, read_overlay

    new = read_overlay(args.overlay)
    _, old, _ = _desired_overlay(args)
    changes = overlay_changes(old or {}, new)
    if not changes:
        print(f"{args.overlay} changes nothing on {args.device}")
        return 0
    for change in changes:
        if not change.had_old:
            print(f"+ {change.key}: {json.dumps(change.new)}")
        elif not change.has_new:
            print(f"- {change.key}: {json.dumps(change.old)}")
        else:
            print(f"~ {change.key}: {json.dumps(change.old)} -> {json.dumps(change.new)}")
    return 0


def _set(args: argparse.Namespace) -> int:
    from agent.fleet.cli.rollout import start_target
    from agent.fleet.cli.trust import DEFAULT_RELEASE_DAYS
    from agent.fleet.deploy.manifest import target_manifest
    from agent.fleet.deploy.overlay import dump_overlay, read_overlay
    from agent.fleet.trust.releases import sign_release

    data = read_overlay(args.overlay)
    text = args.overlay.read_bytes()
    if args.secret:
        data = _sealed(args, data)
        text = dump_overlay(data)
    with tempfile.TemporaryDirectory(prefix="edge-config-") as work:
        # Only sealed values are in this file: it is what the controller keeps and the device gets.
        path = Path(work) / "overlay.yaml"
        path.write_bytes(text)
        document = TargetDocument.overlay_file(path, args.version)
        if args.release_key:
            from agent.protocol.device_targets import CONFIG_TARGET

            out = Path(work) / "release.json"
            sign_release(
                target_manifest(CONFIG_TARGET, path, version=args.version),
                args.release_key,
                out,
                version=1,
                expires_days=DEFAULT_RELEASE_DAYS,
            )
            document = replace(document, release=out.read_text(encoding="utf-8"))
        if args.probation_s is not None:
            document = replace(document, probation_s=args.probation_s)
        # A one-device rollout: one wave, nothing may fail, an offline device is waited for.
        rollout = argparse.Namespace(
            **vars(args),
            waves="100%",
            max_failed="0",
            soak="0",
            wave_timeout="30m",
            on_timeout="wait",
            supersedes=None,
            rollout_id=None,
            release=None,
        )
        rollout.probation_s = document.probation_s
        return start_target(rollout, document, [args.device])


def _sealed(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every ``--secret`` sealed to the device's key (UsageError naming a bad one)."""
    from agent.fleet.ca.layout import CaDir
    from agent.fleet.ca.ledger import IssuedLedger
    from agent.fleet.ca.sealing_key import device_sealing_key
    from agent.fleet.deploy.overlay import with_sealed

    if args.device_cert is None and args.ca_dir is None:
        raise UsageError(
            "--secret needs --ca-dir (the CA's ledger keeps the device's certificate) or --device-cert: "
            "the device's certificate, whose key seals it"
        )
    if args.ca_dir is not None and not CaDir(args.ca_dir).devices_cert.is_file():
        raise UsageError(f"--ca-dir {args.ca_dir}: not a CA directory (`fleet ca init` makes one)")
    ledger = IssuedLedger(CaDir(args.ca_dir).issued) if args.ca_dir is not None else None
    key = device_sealing_key(args.device_cert, args.device, ledger)
    for item in args.secret:
        name, sep, source = item.partition("=@")
        if not sep or not name or not source:
            raise UsageError(
                f"--secret {item.split('=', 1)[0]}=...: write it KEY=@FILE (the file holds the secret)"
            )
        try:
            value = Path(source).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise UsageError(f"--secret {name}: cannot read {source} ({exc.strerror or exc})") from exc
        data = with_sealed(data, name, value, key, args.device)
    return data
