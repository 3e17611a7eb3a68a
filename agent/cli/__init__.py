"""``edge-agent``: parse arguments, load config, hand over. No business logic lives here.

A package so each command with options of its own has its own module beside this one
(``edge-agent build``: :mod:`agent.cli.build`); ``main`` here is the ``edge-agent`` entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from agent import __version__
from agent.cli.broker import add_broker_arguments
from agent.cli.build import add_build_arguments
from agent.cli.help_format import CliParser
from agent.cli.importing import add_import_arguments
from agent.cli.selftest import add_selftest_arguments
from agent.errors import AgentError, ConfigError, UsageError
from agent.fleet.cli.main import FLEET_COMMANDS, add_fleet_arguments
from agent.machine.process import keep_freed_buffers


def _parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="edge-agent", description="Edge inference agent for Jetson fleets.")
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon (systemd: Type=notify)")
    run.add_argument("-c", "--config", type=Path, required=True, help="agent YAML config")

    enroll = sub.add_parser(
        "enroll",
        help="ask for this device's own certificate with the claim of the config's enrollment: section; "
        "wait until it is issued (pending: until an operator accepts)",
    )
    enroll.add_argument("-c", "--config", type=Path, required=True, help="agent YAML config")

    check = sub.add_parser("check-config", help="validate a config file; exit 1 naming every problem")
    # Both spellings: `check-config FILE` is what the docs and the example config show, `-c FILE`
    # matches `run -c FILE`.
    check.add_argument("file", type=Path, nargs="?", metavar="FILE", help="agent YAML config")
    check.add_argument("-c", "--config", type=Path, default=None, help="agent YAML config (same as FILE)")

    schema = sub.add_parser(
        "schema",
        help="write the JSON Schema of every MQTT message: the device's (samples included), the deploy "
        "manifest, the chunk request and the controller's RolloutRequest and RolloutStatus",
    )
    schema.add_argument("--out", type=Path, default=Path("schemas"), help="output directory")

    info = sub.add_parser("info", help="print the platform: JetPack/L4T, CUDA, GPU, DLA, TensorRT, backends")
    info.add_argument("--json", action="store_true", help="machine-readable output")

    build = sub.add_parser("build", help="build or find an engine offline, like trtexec")
    add_build_arguments(build)

    selftest = sub.add_parser(
        "selftest", help="prove what the agent can do on this machine, step by step; JSON + Markdown report"
    )
    add_selftest_arguments(selftest)

    broker = sub.add_parser("broker", help="run a local mosquitto (for configs/local.yaml) until Ctrl-C")
    add_broker_arguments(broker)

    imported = sub.add_parser(
        "import",
        help="check an offline bundle (from a USB stick) with this device's trust rules and hand its desired "
        "states to the agent, running or not",
    )
    add_import_arguments(imported)

    fleet = sub.add_parser("fleet", help=f"operator commands: {', '.join(FLEET_COMMANDS)}")
    add_fleet_arguments(fleet)

    demo = sub.add_parser("demo", help="run the end-to-end demo against a private mosquitto")
    demo.add_argument("--forever", action="store_true", help="run until Ctrl-C instead of ~30 s")
    demo.add_argument("--duration", type=float, default=30.0, help="seconds to run")
    demo.add_argument("--workdir", type=Path, default=None, help="keep the demo's files here")
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary directory of files (default: removed at exit)"
    )
    return parser


#: Exit status when the reader of our output went away (``| head``): 128 + SIGPIPE, as a shell reports
#: a process that SIGPIPE ended.
EXIT_CLOSED_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """The ``edge-agent`` entry point: run the command; every expected failure is one line on stderr."""
    keep_freed_buffers()  # every edge-agent process: the device's and the operator side's alike
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "check-config":
        args.config = _check_config_file(parser, args.file, args.config)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
    except BrokenPipeError:
        return _closed_pipe()
    except UsageError as exc:  # a flag: not about a configuration file
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 1
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


def _check_config_file(parser: argparse.ArgumentParser, file: Path | None, flag: Path | None) -> Path:
    """The file of ``check-config FILE`` or ``check-config -c FILE``; a usage error (exit 2) otherwise."""
    if file is not None and flag is not None and file != flag:
        parser.error(f"check-config: two config files given ({file} and -c {flag}); give one")
    chosen = file or flag
    if chosen is None:
        parser.error("check-config: give the config file: edge-agent check-config FILE")
    return chosen


def _closed_pipe() -> int:
    """``edge-agent fleet status | head -2``: the reader has what it wanted; exit without a traceback.

    Python ignores SIGPIPE, so the write raised instead; what is still buffered for stdout would raise
    again when the interpreter flushes it at exit, so stdout is pointed at /dev/null first.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_CLOSED_PIPE


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from agent.app.root import run

        return run(args.config)
    if args.command == "import":
        from agent.cli.importing import run_import

        return run_import(args)
    if args.command == "enroll":
        from agent.cli.enroll import run_enroll

        return run_enroll(args.config)
    if args.command == "check-config":
        from agent.config import check_config

        problems = check_config(args.config)
        for problem in problems:
            # A problem with the file itself (not found, not YAML) already starts with its name.
            named = problem.startswith(f"{args.config}:")
            print(problem if named else f"{args.config}: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.config}: ok")
        return 1 if problems else 0
    if args.command == "schema":
        from agent.schemas import EVERY_MESSAGE, write_schemas

        for path in write_schemas(args.out, EVERY_MESSAGE):
            print(path)
        return 0
    if args.command == "info":
        from agent.machine.platform import detect_platform, platform_summary

        platform = detect_platform()
        summary = platform_summary(platform)
        if args.json:
            print(json.dumps({"platform": summary, "backends": platform.backends}, indent=2, default=str))
        else:
            from agent.cli.info import info_lines

            for line in info_lines(summary, platform.backends):
                print(line)
        return 0
    if args.command == "build":
        from agent.cli.build import run_build

        return run_build(args)
    if args.command == "selftest":
        from agent.cli.selftest import run_selftest

        return run_selftest(args)
    if args.command == "broker":
        from agent.cli.broker import run_broker

        return run_broker(args.port)
    if args.command == "fleet":
        from agent.fleet.cli.main import run_fleet

        return run_fleet(args)
    if args.command == "demo":
        from agent.demo.run import run_demo

        return run_demo(
            duration=None if args.forever else args.duration, workdir=args.workdir, keep=args.keep
        )
    raise AssertionError(f"unhandled command {args.command}")
