"""The ``edge-agent fleet`` commands that act on devices, run and printed: ``status``, ``watch``,
``cmd``, ``snapshot``, ``evidence``, ``logs`` and ``decommission``.

Their flags are :mod:`agent.fleet.cli.main`'s; the work is done in :mod:`agent.fleet.view` (status,
watch), :mod:`agent.fleet.devices` and :mod:`agent.fleet.deploy.decommission`. Everything a device
sent is printed through :func:`~agent.fleet.base.untrusted.shown` or as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from agent.errors import AgentError, UsageError
from agent.fleet.base.untrusted import shown
from agent.fleet.cli.args import chosen_targets, json_arg
from agent.fleet.cli.connection import settings_from_args
from agent.protocol.messages import CommandReply
from agent.protocol.topics import DEFAULT_PREFIX

#: ``fleet status`` exit code when the prefix holds no device at all (a wrong --prefix or --broker).
EXIT_NO_DEVICES = 1


def run_status(args: argparse.Namespace) -> int:
    """``fleet status``: the fleet's retained status as a table or JSON (exit 1: no device at all)."""
    from agent.fleet.devices.selector import parse_selector
    from agent.fleet.devices.targets import facts_of
    from agent.fleet.view.status import collect_fleet, format_table

    selector = parse_selector(args.select) if args.select is not None else None  # before connecting
    settings = settings_from_args(args)
    rows = collect_fleet(settings, max_wait_s=args.retained_wait, telemetry_wait_s=args.telemetry_wait)
    everyone = len(rows)
    if selector is not None:
        # A device without a retained up/info is never matched: nothing is known about it to match.
        rows = [r for r in rows if r.info_seen and selector.matches(facts_of(r))]
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    elif rows:
        print(format_table(rows))
    if not everyone:
        # Most likely the wrong target, not an empty fleet: say where we looked, and fail.
        print(
            f"no devices found: nothing retained under {settings.prefix}/+/up/status or up/info on "
            f"{settings.host}:{settings.port}; check --prefix (the devices' mqtt.prefix, default "
            f"{DEFAULT_PREFIX}) and --broker",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICES
    if not rows:
        print(
            f"no device of the {everyone} under {settings.prefix} matches --select {args.select}",
            file=sys.stderr,
        )
    return 0


def run_evidence(args: argparse.Namespace) -> int:
    """``fleet evidence``: a rejected job's frames written to a directory."""
    from agent.fleet.devices.evidence import fetch_evidence, save_evidence

    if args.output.exists() and not args.output.is_dir():
        raise UsageError(f"-o {args.output} is a file; name the directory to write the frames to")
    evidence = fetch_evidence(settings_from_args(args), args.device, args.job_id, timeout=args.timeout)
    written = save_evidence(evidence, args.output)
    print(f"{len(evidence.frames)} evidence frame(s) of job {args.job_id} written to {args.output}")
    for path in written:
        print(f"  {path.name}")
    return 0


def run_snapshot(args: argparse.Namespace) -> int:
    """``fleet snapshot``: a device's latest frame written as a JPEG, its result printed."""
    from agent.fleet.base.untrusted import shown
    from agent.fleet.devices.snapshot import save_snapshot, take_snapshot

    if args.max_dimension is not None and not 16 <= args.max_dimension <= 8192:
        raise UsageError("--max-dimension must be 16 to 8192 pixels")
    if args.output.is_dir():
        raise UsageError(f"-o {args.output} is a directory; name the JPEG file to write")
    try:
        snap = take_snapshot(
            settings_from_args(args),
            args.device,
            stream=args.stream,
            max_dimension=args.max_dimension,
            timeout=args.timeout,
        )
    except AgentError as exc:
        if args.json:  # stdout stays JSON: the refusal as fleet cmd prints one; stderr says it too
            print(json.dumps({"ok": False, "error_code": exc.code, "error": str(exc)}, indent=2))
        raise
    save_snapshot(snap, args.output)
    if args.json:
        print(json.dumps(snap.meta, indent=2))
        return 0
    meta = snap.meta
    result = meta.get("result") or {}
    found = result.get("detections") or result.get("classes") or []
    labels = ", ".join(
        f"{shown(item.get('label'), 40)} {float(item.get('score', 0)):.2f}" for item in found[:10]
    )
    print(
        f"{args.output}: stream {shown(meta['stream'])} frame {shown(meta['frame_index'])}, "
        f"{shown(meta['width'])}x{shown(meta['height'])}, {len(snap.jpeg)} bytes; {labels or 'no labels'}"
    )
    return 0


def run_logs(args: argparse.Namespace) -> int:
    """``fleet logs``: a device's latest log lines (``--follow``: until Ctrl-C)."""
    from agent.fleet.cli.serve import install_stop_signals
    from agent.fleet.devices.logs import print_logs

    if not 1 <= args.lines <= 1000:
        raise UsageError("--lines must be 1 to 1000")
    if not args.interval > 0:
        raise UsageError("--interval must be a number of seconds above 0")
    stop = threading.Event()
    if args.follow:
        install_stop_signals(stop)  # Ctrl-C and SIGTERM end the follow with exit 0
    return print_logs(
        settings_from_args(args),
        args.device,
        args.lines,
        sys.stdout,
        sys.stderr,
        follow=args.follow,
        stop=stop,
        interval_s=args.interval,
        timeout=args.timeout,
    )


def run_decommission(args: argparse.Namespace) -> int:
    """``fleet decommission``: a device's retained topics cleared (exit 1: nothing was retained)."""
    from agent.fleet.base.untrusted import shown
    from agent.fleet.deploy.decommission import decommission

    settings = settings_from_args(args)
    done = decommission(
        settings,
        args.device,
        force=args.force,
        max_wait_s=args.retained_wait,
        ca_dir=decommission_ca_dir(args),
    )
    if not done.cleared and not done.revoked:  # a typo must not look like a success
        print(
            f"fleet decommission: nothing retained for {shown(done.device)} under {shown(settings.prefix)}: "
            "nothing cleared (check the id and --prefix)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(done.as_dict(), indent=2))
        return 0
    print(f"decommissioned {shown(done.device)} (its status said {done.state}); retained topics cleared:")
    for topic in done.cleared:
        print(f"  {shown(topic, 300)}")
    if done.broker is not None:
        print(f"certificates revoked: {', '.join(done.revoked) or 'none (it held no current one)'}")
        print(f"broker: {done.broker}")
    return 0


def decommission_ca_dir(args: argparse.Namespace) -> Path | None:
    """``--ca-dir``, or the controller's default CA directory when it holds a CA (else None)."""
    from agent.fleet.ca.layout import DEFAULT_CA_DIR, CaDir

    if args.ca_dir is not None:
        return Path(args.ca_dir)
    return DEFAULT_CA_DIR if CaDir(DEFAULT_CA_DIR).devices_cert.exists() else None


def run_watch(args: argparse.Namespace) -> int:
    """``fleet watch``: one device's messages, live, until Ctrl-C, ``--count`` or ``--duration``."""
    from agent.fleet.cli.serve import install_stop_signals
    from agent.fleet.view.watch import WatchOptions, watch_device

    if args.every < 0:
        raise UsageError("--every must be a number of seconds, 0 or more")
    if args.count is not None and args.count < 1:
        raise UsageError("--count must be 1 or more")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be a number of seconds above 0")
    options = WatchOptions(as_json=args.json, every=args.every, count=args.count, duration=args.duration)
    stop = threading.Event()
    install_stop_signals(stop)  # Ctrl-C and SIGTERM end the watch with exit 0
    return watch_device(settings_from_args(args), args.device, options, stop, out=sys.stdout, err=sys.stderr)


def run_cmd(args: argparse.Namespace) -> int:
    """``fleet cmd``: a command to one device or many, the replies printed as JSON."""
    from agent.fleet.devices.command import (
        OFFLINE,
        NoReplyError,
        Unanswered,
        answer_json,
        ask_devices,
        is_running,
    )

    command_args = json_arg(args.args, "--args")
    if not isinstance(command_args, dict):
        raise UsageError('--args must be a JSON object, e.g. \'{"slot": "cls"}\'')
    settings = settings_from_args(args)
    if args.device is not None and args.select is None and not args.device_list and not args.dry_run:
        # One device named by its id alone: its reply alone, as a script that names one device expects.
        [answer] = ask_devices(
            settings,
            [args.device],
            args.name,
            command_args,
            timeout=args.timeout,
            follow_s=args.running_timeout,
            on_running=_say_running(args.running_timeout),
        ).values()
        if isinstance(answer, Unanswered):
            hint = (
                ""
                if answer.code == OFFLINE
                else "; is it online (`edge-agent fleet status`) and the prefix right?"
            )
            raise NoReplyError(answer.error + hint)
        # Device text: json.dumps escapes control characters (ensure_ascii), and pydantic's JSON mode
        # writes NaN and the infinities as null (tests/fleet/base/test_hostile_devices.py checks both).
        print(json.dumps(answer_json(answer), indent=2))
        return 0 if answer.ok and not is_running(answer) else 1
    # stdout is the replies' JSON alone (`fleet cmd ... > out.json`): the selection goes to stderr.
    targets = chosen_targets(args, ([args.device] if args.device else []) + args.device_list, out=sys.stderr)
    if targets is None:
        return 0
    answers = ask_devices(
        settings,
        targets.devices,
        args.name,
        command_args,
        timeout=args.timeout,
        follow_s=args.running_timeout,
        on_running=_say_running(args.running_timeout),
    )
    print(json.dumps({device: answer_json(answer) for device, answer in answers.items()}, indent=2))
    finished = (not isinstance(a, Unanswered) and a.ok and not is_running(a) for a in answers.values())
    return 0 if all(finished) else 1


def _say_running(follow_s: float) -> Callable[[str, CommandReply], None]:
    """A line on stderr for each device that answered ``state: running``: what is followed, how long."""

    def say(device: str, reply: CommandReply) -> None:
        print(
            f"{shown(device, 64)}: {shown(reply.command, 32)} running on the device; following it to its "
            f"end (up to {follow_s:.0f} s, --running-timeout; Ctrl-C stops waiting, not the device's work)",
            file=sys.stderr,
            flush=True,
        )

    return say
