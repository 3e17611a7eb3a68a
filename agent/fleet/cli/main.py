"""``edge-agent fleet ...``: the operator commands (keygen, deploy, serve, status, watch, cmd,
snapshot, evidence, samples, engines, logs, decommission, ca, devices, controller, rollout, trust,
config, agent).

:func:`add_fleet_arguments` fills the ``fleet`` sub-parser, :func:`run_fleet` runs the chosen
command and returns the exit code. ``fleet deploy`` itself is :mod:`agent.fleet.cli.deploy`, the
commands that act on devices (status, watch, cmd, snapshot, evidence, logs, decommission)
:mod:`agent.fleet.cli.device_commands`, flags several commands share :mod:`agent.fleet.cli.args`;
the work is done by
:mod:`agent.fleet.deploy.run`, ``serve``, ``status``, ``watch``, ``command`` and ``keys``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import UsageError
from agent.fleet.cli import device_commands
from agent.fleet.cli.admission import add_admission_arguments, run_admission
from agent.fleet.cli.args import add_retained_wait, add_target_arguments
from agent.fleet.cli.bundle import add_bundle_arguments, run_bundle
from agent.fleet.cli.ca import add_ca_arguments, add_ca_dir, run_ca, run_revoke
from agent.fleet.cli.connection import add_broker_arguments, settings_from_args
from agent.fleet.cli.deploy import add_manifest_arguments, run_deploy
from agent.fleet.cli.rollout import add_controller_arguments, run_controller_command, run_rollout
from agent.fleet.cli.target import add_agent_arguments, add_config_arguments, run_agent, run_config
from agent.fleet.cli.trust import add_trust_arguments, run_trust
from agent.fleet.controller.config import DEFAULT_STATE_DIR
from agent.fleet.deploy.run import DEFAULT_STATUS_POLL_S
from agent.fleet.devices.command import FOLLOW_S
from agent.logs.setup import configure_logging

if TYPE_CHECKING:
    from agent.fleet.samples.store import SampleStore

#: ``fleet status --telemetry-wait`` default: the agent's default telemetry interval (10 s) and a margin.
DEFAULT_TELEMETRY_WAIT_S = 11.0


#: The ``fleet`` sub-commands, as ``edge-agent --help`` lists them (a test checks it is every one).
FLEET_COMMANDS = (
    "keygen",
    "deploy",
    "serve",
    "status",
    "watch",
    "cmd",
    "snapshot",
    "evidence",
    "samples",
    "engines",
    "logs",
    "decommission",
    "ca",
    "devices",
    "controller",
    "rollout",
    "trust",
    "bundle",
    "config",
    "agent",
)


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleet`` sub-commands to ``parser`` (the ``fleet`` sub-parser of ``edge-agent``)."""
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")

    keygen = sub.add_parser("keygen", help="make an Ed25519 key pair for signing deploy manifests")
    keygen.add_argument("--out", type=Path, required=True, help="directory for KEY_ID.key and KEY_ID.pub")
    keygen.add_argument("--key-id", default="fleet", help="id devices know the key by (default fleet)")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")

    deploy = sub.add_parser("deploy", help="deploy a model to devices and follow their jobs")
    deploy.add_argument("model", type=Path, metavar="MODEL.onnx", help="the ONNX model file to deploy")
    add_target_arguments(deploy)
    add_manifest_arguments(deploy)
    signing = deploy.add_mutually_exclusive_group(required=True)
    signing.add_argument("--key", type=Path, help="private key file from `fleet keygen` (needs --key-id)")
    signing.add_argument(
        "--unsigned", action="store_true", help="publish unsigned (devices must not require signatures)"
    )
    deploy.add_argument("--key-id", default=None, help="the key's id in the devices' delivery.trusted_keys")
    deploy.add_argument(
        "--release",
        type=Path,
        default=None,
        metavar="FILE",
        help="the model's release from `fleet trust release`, for devices with a fleet root (--key is then "
        "the controller key; --key-id defaults to its key id)",
    )
    deploy.add_argument("--http-url", default=None, help="HTTP(S) URL of the same file, tried before MQTT")
    deploy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for all devices (the deploy's one wave)"
    )
    deploy.add_argument("--no-serve", action="store_true", help="do not serve chunks (a `fleet serve` does)")
    deploy.add_argument(
        "--max-rate",
        type=float,
        default=None,
        help="cap the chunk bytes this deploy serves per second (no `fleet serve` may run beside it)",
    )
    deploy.add_argument(
        "--wait-unknown",
        action="store_true",
        help="publish to and wait for devices with no retained status (not yet connected) too",
    )
    deploy.add_argument(
        "--status-poll",
        type=float,
        default=DEFAULT_STATUS_POLL_S,
        metavar="SECONDS",
        help=f"ask a device quiet this long for its job state (default {DEFAULT_STATUS_POLL_S:.0f})",
    )
    add_broker_arguments(deploy)
    _add_verbose(deploy)

    trust = sub.add_parser(
        "trust", help="the fleet root of trust: keys, root versions, releases (docs/trust.md)"
    )
    add_trust_arguments(trust)

    bundle = sub.add_parser(
        "bundle",
        help="write one signed file holding what the controller publishes for some devices (desired "
        "states, root chain, files) for `edge-agent import` where there is no network (docs/bundles.md)",
    )
    add_bundle_arguments(bundle)

    serve = sub.add_parser("serve", help="serve model chunks from a directory until SIGTERM")
    serve.add_argument("--repo", type=Path, required=True, help="directory of model files")
    serve.add_argument(
        "--group",
        default=None,
        help="shared subscription group, to share the load with other fleet serve processes: a name "
        "devices cannot guess (default: a random one of this process)",
    )
    serve.add_argument(
        "--report", type=float, default=60.0, metavar="SECONDS", help="print counters this often (0: never)"
    )
    add_broker_arguments(serve)
    _add_verbose(serve)

    status = sub.add_parser("status", help="table of devices from their retained status and info")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--select", default=None, metavar="SELECTOR", help="only the devices this selector matches"
    )
    add_retained_wait(status, old="--wait", what="the devices' retained status and info")
    status.add_argument(
        "--telemetry-wait",
        type=float,
        default=DEFAULT_TELEMETRY_WAIT_S,
        metavar="SECONDS",
        help="longest wait for each online device's next telemetry (fps, CPU, temperature; not "
        f"retained, sent every telemetry.interval_s); 0 skips it (default {DEFAULT_TELEMETRY_WAIT_S:.0f})",
    )
    add_broker_arguments(status)
    _add_verbose(status)

    watch = sub.add_parser("watch", help="print a device's results, telemetry and status live")
    watch.add_argument("device", metavar="DEVICE", help="device id")
    watch.add_argument("--json", action="store_true", help="one JSON object per message, every result")
    watch.add_argument(
        "--every",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="text mode: at most one result line per stream this often (default 1; 0: every result)",
    )
    watch.add_argument("--count", type=int, default=None, help="stop after printing this many messages")
    watch.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    add_broker_arguments(watch)
    _add_verbose(watch)

    cmd = sub.add_parser("cmd", help="send a command to a device and print its reply")
    cmd.add_argument("device", nargs="?", default=None, help="device id (or --device / --select)")
    cmd.add_argument("name", help="command name: status, rollback, ...")
    add_target_arguments(cmd, positional=True)
    cmd.add_argument(
        "--args", default="{}", help='command arguments as a JSON object, e.g. \'{"slot": "cls"}\''
    )
    cmd.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the reply")
    cmd.add_argument(
        "--running-timeout",
        type=float,
        default=FOLLOW_S,
        metavar="SECONDS",
        help="longest wait for the final reply of a device that answered state running (a rollback "
        "rebuilding its engine)",
    )
    add_broker_arguments(cmd)
    _add_verbose(cmd)

    snap = sub.add_parser(
        "snapshot", help="save a device's latest frame of a stream as a JPEG, with that frame's result"
    )
    snap.add_argument("device", metavar="DEVICE", help="device id")
    snap.add_argument("--stream", default=None, help="stream name (default: the device's first stream)")
    snap.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="JPEG file to write")
    snap.add_argument(
        "--max-dimension",
        type=int,
        default=None,
        metavar="PIXELS",
        help="longest side wanted (the device's snapshot.max_dimension caps it)",
    )
    snap.add_argument("--json", action="store_true", help="print the reply (without the JPEG) as JSON")
    snap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the reply")
    add_broker_arguments(snap)
    _add_verbose(snap)

    ev = sub.add_parser(
        "evidence", help="save the frames a device's shadow run rejected a job's model on, with both outputs"
    )
    ev.add_argument("device", metavar="DEVICE", help="device id")
    ev.add_argument("job_id", metavar="JOB_ID", help="the rejected deployment job")
    ev.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="directory to write")
    ev.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each reply")
    add_broker_arguments(ev)
    _add_verbose(ev)

    samples = sub.add_parser(
        "samples", help="the devices' opt-in samples for retraining, kept by the controller"
    )
    samples_sub = samples.add_subparsers(dest="samples_command", required=True, metavar="COMMAND")
    export = samples_sub.add_parser(
        "export",
        help="write the controller's samples as a dataset with the model's predictions as pre-labels "
        "(reads STATE_DIR/samples on the controller host, or the database its --config names)",
    )
    export.add_argument(
        "--format",
        choices=("coco", "folders"),
        required=True,
        help="coco: COCO JSON and images/ (detectors); folders: a folder of JPEGs per top-1 label "
        "(classifiers)",
    )
    export.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="directory to write")
    where = export.add_mutually_exclusive_group()
    where.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the controller's state_dir, which holds samples/ (default: the unit's, {DEFAULT_STATE_DIR})",
    )
    where.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the controller's YAML: its database (database.url) or its state_dir holds the samples",
    )
    _add_verbose(export)

    engines = sub.add_parser(
        "engines", help="the engines the controller holds for the fleet (built once each)"
    )
    engines_sub = engines.add_subparsers(dest="engines_command", required=True, metavar="VERB")
    listing = engines_sub.add_parser(
        "list", help="per fingerprint: key, size, who built it, when, reuse count"
    )
    listing.add_argument(
        "--json", action="store_true", help="the controller's answer as JSON (docs/fleet.md)"
    )
    listing.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the controller")
    add_broker_arguments(listing)
    _add_verbose(listing)
    release = engines_sub.add_parser(
        "release",
        help="end a stuck build claim: the next device asking for the key builds it (no one waits for it)",
    )
    release.add_argument(
        "key", metavar="KEY", help="the engine cache key, or its start as listed (at least 6 characters)"
    )
    release.add_argument(
        "--reason",
        default="",
        metavar="TEXT",
        help="why (logged by the controller, kept with the claim's end)",
    )
    release.add_argument("--json", action="store_true", help="the controller's answer as JSON")
    release.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the controller")
    add_broker_arguments(release)
    _add_verbose(release)
    logs = sub.add_parser("logs", help="print a device's latest log lines (secrets redacted on the device)")
    logs.add_argument("device", metavar="DEVICE", help="device id")
    logs.add_argument(
        "-n", "--lines", type=int, default=100, help="how many of the latest lines (1 to 1000, default 100)"
    )
    logs.add_argument("-f", "--follow", action="store_true", help="then print new lines until Ctrl-C")
    logs.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="--follow: how often to ask for new lines (default 1)",
    )
    logs.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each reply")
    add_broker_arguments(logs)
    _add_verbose(logs)

    gone = sub.add_parser(
        "decommission",
        help="clear a device's retained status, info and desired states: the controller forgets it",
    )
    gone.add_argument("device", metavar="DEVICE", help="device id")
    gone.add_argument(
        "--force",
        action="store_true",
        help="clear it even while its status says online (a device gone without its Last Will)",
    )
    gone.add_argument("--json", action="store_true", help="machine-readable output")
    gone.add_argument(
        "--retained-wait",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="longest time to collect its retained messages",
    )
    add_ca_dir(
        gone,
        "also revoke its certificates in this CA directory and tell the broker "
        "(default: the controller's, when it holds a CA)",
    )
    add_broker_arguments(gone)
    _add_verbose(gone)

    add_admission_arguments(add_ca_arguments(sub))
    add_controller_arguments(sub)
    add_config_arguments(sub)
    add_agent_arguments(sub)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_fleet(args: argparse.Namespace) -> int:
    """Run the ``fleet`` sub-command ``args`` describes; return the exit code.

    Raises AgentError (ConfigError, TransportError) for the caller to print.
    """
    command = args.fleet_command
    quiet = "error" if command != "controller" else "info"  # a daemon logs what it does
    # A command's stdout carries its output (JSON with --json, `fleet cmd`): its logs go to stderr.
    stream = None if command == "controller" else sys.stderr
    configure_logging("console", "info" if getattr(args, "verbose", False) else quiet, stream)
    if command == "keygen":
        return _keygen(args)
    if command == "deploy":
        return run_deploy(args)
    if command == "bundle":
        return run_bundle(args)
    if command == "serve":
        return _serve(args)
    if command == "status":
        return device_commands.run_status(args)
    if command == "watch":
        return device_commands.run_watch(args)
    if command == "cmd":
        return device_commands.run_cmd(args)
    if command == "snapshot":
        return device_commands.run_snapshot(args)
    if command == "evidence":
        return device_commands.run_evidence(args)
    if command == "samples":
        return _samples_export(args)
    if command == "engines":
        return _engines_release(args) if args.engines_command == "release" else _engines_list(args)
    if command == "logs":
        return device_commands.run_logs(args)
    if command == "decommission":
        return device_commands.run_decommission(args)
    if command == "ca":
        return run_ca(args)
    if command == "devices":
        return run_revoke(args) if args.devices_command == "revoke" else run_admission(args)
    if command == "controller":
        return run_controller_command(args)
    if command == "rollout":
        return run_rollout(args)
    if command == "trust":
        return run_trust(args)
    if command == "config":
        return run_config(args)
    if command == "agent":
        return run_agent(args)
    raise AssertionError(f"unhandled fleet command {command}")


# -- engines ---------------------------------------------------------------------------------------


def _engines_list(args: argparse.Namespace) -> int:
    from agent.fleet.controller.client import ControllerClient
    from agent.fleet.engines.listing import engines_table

    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        listing = client.request("engines", {})
    print(json.dumps(listing, indent=2, sort_keys=True) if args.json else engines_table(listing))
    return 0


def _engines_release(args: argparse.Namespace) -> int:
    """``fleet engines release KEY``: exit 0 with the claim ended, 1 with the controller's refusal
    (``unknown_claim``, ``ambiguous_key``), printed with its code (as JSON with ``--json``)."""
    from agent.fleet.controller.client import ControllerClient, RequestRefusedError
    from agent.fleet.engines.listing import released_line

    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        try:
            result = client.request("engines_release", {"key": args.key, "reason": args.reason})
        except RequestRefusedError as exc:
            if args.json:
                print(json.dumps({"released": False, "error_code": exc.code, "error": exc.reason}, indent=2))
            else:
                print(f"error: {exc.reason} ({exc.code})", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else released_line(result))
    return 0


# -- keygen ----------------------------------------------------------------------------------------


def _keygen(args: argparse.Namespace) -> int:
    from agent.fleet.deploy.keys import write_keypair

    pair = write_keypair(args.out, args.key_id, overwrite=args.force)
    print(f"private key  {pair.private}  (mode 0600; keep it on the operator machine)")
    print(f"public key   {pair.public}  (fingerprint {pair.fingerprint})")
    print("trust it on each device (agent.yaml), then deploy with:")
    print(f"  delivery:\n    trusted_keys:\n      {pair.key_id}: /etc/edge-agent/keys/{pair.public.name}")
    print(f"  edge-agent fleet deploy MODEL.onnx --key {pair.private} --key-id {pair.key_id} ...")
    return 0


# -- deploy ----------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from agent.fleet.cli.serve import install_stop_signals, serve_repo

    if not args.repo.is_dir():
        raise UsageError(f"--repo {args.repo} is not a directory")
    settings = settings_from_args(args)
    stop = threading.Event()
    install_stop_signals(stop)
    serve_repo(settings, args.repo, stop, group=args.group, out=sys.stdout, report_s=args.report)
    return 0


def _samples_export(args: argparse.Namespace) -> int:
    from agent.fleet.samples.export import export_samples, summary_json
    from agent.fleet.samples.store import FileSampleStore

    if args.output.exists() and not args.output.is_dir():
        raise UsageError(f"-o {args.output} is a file; name the directory to write the dataset to")
    store: SampleStore
    if args.config is not None:
        store = _configured_samples(args.config)
    else:
        state_dir = args.state_dir or DEFAULT_STATE_DIR
        directory = state_dir / "samples"
        if not directory.is_dir():
            raise UsageError(
                f"--state-dir {state_dir}: no samples/ there (not the controller's state_dir, or no "
                "device has sent a sample yet)"
            )
        store = FileSampleStore(directory)
    try:
        summary = export_samples(store, args.format, args.output)
    finally:
        store.close()
    print(summary_json(summary, args.format, args.output))
    return 0


def _configured_samples(config_path: Path) -> SampleStore:
    """The samples of the controller ``config_path`` configures: in its database, or its state_dir."""
    from agent.fleet.controller.config import load_controller_config
    from agent.fleet.samples.pg_store import PostgresSampleStore
    from agent.fleet.samples.store import FileSampleStore
    from agent.fleet.statedb.postgres import StateDatabase, conninfo_of

    config = load_controller_config(config_path)
    if config.database.url is not None:
        # Read only: the schema is the controller's to migrate, never an export's.
        database = StateDatabase(conninfo_of(config.database), name="samples-export")
        return PostgresSampleStore(database, migrate=False)
    if not config.samples_dir.is_dir():
        raise UsageError(
            f"-c {config_path}: no samples/ in its state_dir {config.state_dir} (no device has sent a "
            "sample yet)"
        )
    return FileSampleStore(config.samples_dir)
