"""``edge-agent fleet ...``: the operator commands (keygen, deploy, serve, status, watch, cmd).

:func:`add_fleet_arguments` fills the ``fleet`` sub-parser, :func:`run_fleet` runs the chosen
command and returns the exit code. The work is done by :mod:`agent.fleet.deploy`, ``serve``,
``status``, ``watch``, ``command`` and ``keys``; this module only turns flags into their arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from agent.camera.preprocess_spec import PreprocessSpec
from agent.delivery.guard import ProbationSpec, ShadowSpec
from agent.delivery.manifest import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from agent.engines.spec import BuildSpec
from agent.errors import AgentError, UsageError
from agent.fleet.connection import add_broker_arguments, settings_from_args
from agent.fleet.deploy import DEFAULT_STATUS_POLL_S
from agent.fleet.deploy_plan import DEFAULT_PROBATION_S
from agent.fleet.untrusted import shown
from agent.logs import configure_logging
from agent.postprocess.spec import ClassificationSpec, DetectionSpec, PostprocessSpec

if TYPE_CHECKING:
    from agent.fleet.deploy_outcome import DeployOutcome, DeviceProgress
    from agent.fleet.targets import Targets

SpecT = TypeVar("SpecT", bound=BaseModel)

#: Exit codes of ``fleet deploy`` (docs/fleet.md): every device ACTIVE; a device ended in a failure
#: state; some device unfinished at --timeout; a device sent a message that did not parse (and none
#: failed); a device was unknown (no retained status, no --wait-unknown). A failure outranks a
#: malformed message, which outranks an unknown device, which outranks unfinished: a device whose
#: end state did not parse is also unfinished, and the malformed message is what the operator must
#: see; a misspelt id is news, the others' timeout follows from it.
EXIT_OK, EXIT_FAILED, EXIT_UNFINISHED, EXIT_MALFORMED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
#: ``fleet status --telemetry-wait`` default: the agent's default telemetry interval (10 s) and a margin.
DEFAULT_TELEMETRY_WAIT_S = 11.0
#: Longest summary line printed per device (its error text is the device's).
_SUMMARY_WIDTH = 300


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleet`` sub-commands to ``parser`` (the ``fleet`` sub-parser of ``edge-agent``)."""
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")

    keygen = sub.add_parser("keygen", help="make an Ed25519 key pair for signing deploy manifests")
    keygen.add_argument("--out", type=Path, required=True, help="directory for KEY_ID.key and KEY_ID.pub")
    keygen.add_argument("--key-id", default="fleet", help="id devices know the key by (default fleet)")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")

    deploy = sub.add_parser("deploy", help="deploy a model to devices and follow their jobs")
    deploy.add_argument("model", type=Path, metavar="MODEL.onnx")
    _add_target_arguments(deploy)
    deploy.add_argument("--slot", required=True, help="model slot on the devices")
    deploy.add_argument("--version", required=True, help="model version reported with results")
    deploy.add_argument("--model-id", default=None, help="model name (default: the file name's stem)")
    deploy.add_argument("--precision", choices=("fp32", "fp16", "int8", "best"), default=None)
    deploy.add_argument(
        "--device-target",
        choices=("auto", "gpu", "dla0", "dla1", "cpu"),
        default=None,
        help="where the engine runs (TensorRT devices); with --precision this asks for an engine build",
    )
    deploy.add_argument("--no-gpu-fallback", action="store_true", help="DLA only: no GPU fallback layers")
    signing = deploy.add_mutually_exclusive_group(required=True)
    signing.add_argument("--key", type=Path, help="private key file from `fleet keygen` (needs --key-id)")
    signing.add_argument(
        "--unsigned", action="store_true", help="publish unsigned (devices must not require signatures)"
    )
    deploy.add_argument("--key-id", default=None, help="the key's id in the devices' delivery.trusted_keys")
    deploy.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help=f"bytes per chunk (default {DEFAULT_CHUNK_SIZE})",
    )
    deploy.add_argument("--http-url", default=None, help="HTTP(S) URL of the same file, tried before MQTT")
    deploy.add_argument("--preprocess-json", default=None, help="PreprocessSpec JSON (or @file)")
    deploy.add_argument("--postprocess-json", default=None, help="PostprocessSpec JSON (or @file)")
    deploy.add_argument("--labels", type=Path, default=None, help="class names, one per line")
    deploy.add_argument(
        "--shadow-json",
        default=None,
        help='shadow comparison before the swap: ShadowSpec JSON (or @file); "{}" for the defaults',
    )
    deploy.add_argument(
        "--probation-s",
        type=float,
        default=DEFAULT_PROBATION_S,
        help=f"seconds of probation after the swap (default {DEFAULT_PROBATION_S:g}; 0: none, and the "
        "manifest leaves the field out, as older agents need)",
    )
    deploy.add_argument(
        "--probation-json", default=None, help="probation health bars: ProbationSpec JSON (or @file)"
    )
    deploy.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all devices")
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

    serve = sub.add_parser("serve", help="serve model chunks from a directory until SIGTERM")
    serve.add_argument("--repo", type=Path, required=True, help="directory of model files")
    serve.add_argument(
        "--group",
        default=None,
        help="shared subscription group, to share the load with other fleet serve processes: a name "
        "devices cannot guess (default: a random one of this process)",
    )
    serve.add_argument("--report", type=float, default=60.0, help="print counters every N seconds (0: never)")
    add_broker_arguments(serve)
    _add_verbose(serve)

    status = sub.add_parser("status", help="table of devices from their retained status and info")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--select", default=None, metavar="SELECTOR", help="only the devices this selector matches"
    )
    status.add_argument("--wait", type=float, default=5.0, help="longest time to collect retained messages")
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
    _add_target_arguments(cmd, positional=True)
    cmd.add_argument(
        "--args", default="{}", help='command arguments as a JSON object, e.g. \'{"slot": "cls"}\''
    )
    cmd.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the reply")
    add_broker_arguments(cmd)
    _add_verbose(cmd)


def _add_target_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
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
    parser.add_argument(
        "--select-wait",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="longest time to collect the retained up/info --select is checked against (default 5)",
    )


def _targets(args: argparse.Namespace, explicit: list[str]) -> Targets | None:
    """The devices ``args`` name, printed; None when ``--dry-run`` says to stop there."""
    from agent.fleet.deploy_plan import parse_devices
    from agent.fleet.targets import resolve_targets

    targets = resolve_targets(
        settings_from_args(args), args.select, parse_devices(explicit), wait_s=args.select_wait
    )
    for line in targets.lines():
        print(f"{args.fleet_command}: {line}")
    if args.dry_run:
        print(f"{args.fleet_command}: --dry-run: nothing sent")
        return None
    return targets


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_fleet(args: argparse.Namespace) -> int:
    """Run the ``fleet`` sub-command ``args`` describes; return the exit code.

    Raises AgentError (ConfigError, TransportError) for the caller to print.
    """
    configure_logging("console", "info" if getattr(args, "verbose", False) else "error")
    command = args.fleet_command
    if command == "keygen":
        return _keygen(args)
    if command == "deploy":
        return _deploy(args)
    if command == "serve":
        return _serve(args)
    if command == "status":
        return _status(args)
    if command == "watch":
        return _watch(args)
    if command == "cmd":
        return _cmd(args)
    raise AssertionError(f"unhandled fleet command {command}")


# -- keygen ----------------------------------------------------------------------------------------


def _keygen(args: argparse.Namespace) -> int:
    from agent.fleet.keys import write_keypair

    pair = write_keypair(args.out, args.key_id, overwrite=args.force)
    print(f"private key  {pair.private}  (mode 0600; keep it on the operator machine)")
    print(f"public key   {pair.public}  (fingerprint {pair.fingerprint})")
    print("trust it on each device (agent.yaml), then deploy with:")
    print(f"  delivery:\n    trusted_keys:\n      {pair.key_id}: /etc/edge-agent/keys/{pair.public.name}")
    print(f"  edge-agent fleet deploy MODEL.onnx --key {pair.private} --key-id {pair.key_id} ...")
    return 0


# -- deploy ----------------------------------------------------------------------------------------


def _spec_arg(model: type[SpecT], value: str | None, flag: str) -> SpecT | None:
    """``value`` (JSON or @file) validated as ``model``; a UsageError naming ``flag`` when it is not."""
    if value is None:
        return None
    try:
        return model.model_validate(_json_arg(value, flag))
    except ValidationError as exc:
        raise UsageError(f"invalid {flag}", _validation_problems(exc, flag)) from exc


def _json_arg(value: str, flag: str) -> Any:
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


def _validation_problems(exc: ValidationError, flag: str) -> list[str]:
    return [
        f"{flag} {'.'.join(str(p) for p in e['loc']) or '(value)'}: {e['msg']}"
        for e in exc.errors(include_url=False)
    ]


def _read_labels(path: Path) -> list[str]:
    try:
        labels = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise UsageError(f"--labels: cannot read {path}: {exc.strerror or exc}") from exc
    if not labels:
        raise UsageError(f"--labels: {path} holds no class names (one per line expected)")
    return labels


def postprocess_from_args(postprocess_json: str | None, labels_file: Path | None) -> PostprocessSpec | None:
    """The manifest's postprocess: ``--postprocess-json``, with ``--labels`` put into it.

    ``--labels`` alone means a classification with those labels (top 5, or fewer classes).
    """
    labels = _read_labels(labels_file) if labels_file is not None else None
    spec: PostprocessSpec | None = None
    if postprocess_json is not None:
        try:
            spec = TypeAdapter(PostprocessSpec).validate_python(
                _json_arg(postprocess_json, "--postprocess-json")
            )
        except ValidationError as exc:
            raise UsageError(
                "invalid --postprocess-json", _validation_problems(exc, "--postprocess-json")
            ) from exc
    if labels is None:
        return spec
    if spec is None:
        return ClassificationSpec(labels=labels, top_k=min(5, len(labels)))
    if not isinstance(spec, (ClassificationSpec, DetectionSpec)):
        raise UsageError("--labels needs a classification or detection postprocess")
    return spec.model_copy(update={"labels": labels, "labels_file": None})


def build_spec_from_args(args: argparse.Namespace) -> BuildSpec | None:
    """A BuildSpec when any build flag is given; None runs the ONNX model as it is."""
    if args.precision is None and args.device_target is None and not args.no_gpu_fallback:
        return None
    values: dict[str, Any] = {"gpu_fallback": not args.no_gpu_fallback}
    if args.precision is not None:
        values["precision"] = args.precision
    if args.device_target is not None:
        values["device"] = args.device_target
    return BuildSpec.model_validate(values)


def probation_s_from_arg(value: float) -> float | None:
    """The manifest's ``probation_s`` for ``--probation-s`` (pure): 0 leaves the field out.

    The 60 s default lives here, where operators create manifests, not in the manifest model: a
    manifest without the field keeps meaning "no probation" for older manifests and agents. A 0
    leaves the field out rather than sending 0, so an agent that predates probation (it refuses
    unknown manifest keys) still accepts the deploy.
    """
    if not 0 <= value <= 86_400:
        raise UsageError("--probation-s must be between 0 and 86400 seconds")
    return value or None


def _deploy(args: argparse.Namespace) -> int:
    from agent.fleet.deploy import FleetDeploy
    from agent.fleet.deploy_plan import DeployPlan
    from agent.fleet.keys import load_signing_key
    from agent.fleet.progress import ProgressView, describe_manifest, format_bytes

    if not args.model.is_file():
        raise UsageError(f"MODEL.onnx: {args.model} is not a file")
    if args.key is not None and not args.key_id:
        raise UsageError("--key needs --key-id: the id the devices' delivery.trusted_keys know the key by")
    if not args.status_poll > 0:
        raise UsageError("--status-poll must be a number of seconds above 0")
    if not MIN_CHUNK_SIZE <= args.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes")
    preprocess = None
    if args.preprocess_json is not None:
        try:
            preprocess = PreprocessSpec.model_validate(_json_arg(args.preprocess_json, "--preprocess-json"))
        except ValidationError as exc:
            raise UsageError(
                "invalid --preprocess-json", _validation_problems(exc, "--preprocess-json")
            ) from exc
    shadow = _spec_arg(ShadowSpec, args.shadow_json, "--shadow-json")
    probation = _spec_arg(ProbationSpec, args.probation_json, "--probation-json")
    probation_s = probation_s_from_arg(args.probation_s)
    targets = _targets(args, args.device)
    if targets is None:
        return EXIT_OK
    plan = DeployPlan(
        model=args.model,
        devices=targets.devices,
        slot=args.slot,
        version=args.version,
        model_id=args.model_id,
        chunk_size=args.chunk_size,
        build=build_spec_from_args(args),
        preprocess=preprocess,
        postprocess=postprocess_from_args(args.postprocess_json, args.labels),
        http_url=args.http_url,
        shadow=shadow,
        probation_s=probation_s,
        probation=probation,
    )
    settings = settings_from_args(args)
    key = load_signing_key(args.key) if args.key is not None else None
    view = ProgressView()
    deploy = FleetDeploy(
        settings,
        plan,
        signing_key=key,
        key_id=args.key_id,
        serve=not args.no_serve,
        max_rate_bps=args.max_rate,
        on_change=view.update,
        status_poll_s=args.status_poll,
        wait_unknown=args.wait_unknown,
    )
    print(f"deploy: {describe_manifest(deploy.manifest)}")
    if key is not None:
        print(f"deploy: signed with key id {args.key_id}")
    else:
        print("deploy: UNSIGNED; only devices with delivery.require_signature: false accept it")
    with deploy:
        topic = f"{settings.prefix}/{{device}}/down/desired/{plan.slot}"
        serving = "; serving the chunks" if deploy.server is not None else "; chunks left to `fleet serve`"
        if args.max_rate and deploy.server is not None:
            serving += f" at most {format_bytes(args.max_rate)}/s"
        devices = deploy.snapshot()
        published = sum(1 for p in devices if not p.skipped)
        print(f"deploy: published to {published} device(s) on {topic} (retained){serving}")
        _print_unknown(devices, settings.prefix, waiting=args.wait_unknown)
        view.update(deploy.snapshot(), force=True)
        outcome = deploy.wait(args.timeout)
        view.close(deploy.snapshot())
    return _report_outcome(outcome, plan.slot)


def _print_unknown(devices: list[DeviceProgress], prefix: str, *, waiting: bool) -> None:
    """Say at once which targets have no retained status (never connected, or a misspelt id)."""
    unknown = [shown(p.device, 64) for p in devices if p.unknown]
    if not unknown:
        return
    names = ", ".join(unknown[:20]) + (f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else "")
    where = f"{prefix}/{{device}}/up/status"
    if waiting:
        print(f"deploy: unknown device(s) {names}: no retained {where}; waiting for them to connect")
    else:
        print(
            f"deploy: unknown device(s) {names}: no retained {where} (never connected to this broker "
            "under this prefix, or misspelt); not deployed to; --wait-unknown waits for them",
            file=sys.stderr,
        )


def _report_outcome(outcome: DeployOutcome, slot: str) -> int:
    """Print how the deploy ended (device text made safe for the terminal); return the exit code."""
    total = len(outcome.devices)
    malformed = outcome.malformed_lines()
    if malformed:
        bad = sum(1 for p in outcome.devices.values() if p.malformed)
        print(f"deploy: {bad} device(s) sent malformed messages:", file=sys.stderr)
        for line in malformed:
            print(f"  {shown(line, _SUMMARY_WIDTH)}", file=sys.stderr)
    for line in outcome.rate_cap_lines():
        print(f"deploy: {shown(line, _SUMMARY_WIDTH)}", file=sys.stderr)
    if outcome.ok:
        print(f"deploy: all {total} device(s) ACTIVE on {slot}")
        return EXIT_MALFORMED if malformed else EXIT_OK
    failures = outcome.failures()
    print(f"deploy: {len(failures)} of {total} device(s) did not reach ACTIVE:", file=sys.stderr)
    for line in failures:
        print(f"  {shown(line, _SUMMARY_WIDTH)}", file=sys.stderr)
    if outcome.failed:
        return EXIT_FAILED
    if malformed:
        return EXIT_MALFORMED
    return EXIT_UNKNOWN if outcome.skipped else EXIT_UNFINISHED


# -- serve, status, cmd ----------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from agent.fleet.serve import install_stop_signals, serve_repo

    if not args.repo.is_dir():
        raise UsageError(f"--repo {args.repo} is not a directory")
    settings = settings_from_args(args)
    stop = threading.Event()
    install_stop_signals(stop)
    serve_repo(settings, args.repo, stop, group=args.group, out=sys.stdout, report_s=args.report)
    return 0


def _status(args: argparse.Namespace) -> int:
    from agent.fleet.selector import parse_selector
    from agent.fleet.status import collect_fleet, format_table
    from agent.fleet.targets import facts_of

    selector = parse_selector(args.select) if args.select is not None else None  # before connecting
    rows = collect_fleet(settings_from_args(args), max_wait_s=args.wait, telemetry_wait_s=args.telemetry_wait)
    if selector is not None:
        # A device without a retained up/info is never matched: nothing is known about it to match.
        rows = [r for r in rows if r.info_seen and selector.matches(facts_of(r))]
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    elif rows:
        print(format_table(rows))
    else:
        print("no devices found (nothing retained under the prefix; check --prefix and the broker)")
    return 0


def _watch(args: argparse.Namespace) -> int:
    from agent.fleet.serve import install_stop_signals
    from agent.fleet.watch import WatchOptions, watch_device

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


def _cmd(args: argparse.Namespace) -> int:
    from agent.fleet.command import send_command

    command_args = _json_arg(args.args, "--args")
    if not isinstance(command_args, dict):
        raise UsageError('--args must be a JSON object, e.g. \'{"slot": "cls"}\'')
    if args.device is not None and args.select is None and not args.device_list and not args.dry_run:
        # One device named the old way: its reply alone, as before selectors existed.
        reply = send_command(
            settings_from_args(args), args.device, args.name, command_args, timeout=args.timeout
        )
        # Device text: json.dumps escapes control characters (ensure_ascii), and pydantic's JSON mode
        # writes NaN and the infinities as null (tests/fleet/test_hostile_devices.py checks both).
        print(json.dumps(reply.model_dump(mode="json", exclude_none=True), indent=2))
        return 0 if reply.ok else 1
    targets = _targets(args, ([args.device] if args.device else []) + args.device_list)
    if targets is None:
        return 0
    return _cmd_each(args, targets.devices, command_args)


def _cmd_each(args: argparse.Namespace, devices: tuple[str, ...], command_args: dict[str, Any]) -> int:
    """Send the command to each device in turn; one JSON object of replies by device id."""
    from agent.fleet.command import send_command

    replies: dict[str, Any] = {}
    ok = True
    for device in devices:
        try:
            reply = send_command(
                settings_from_args(args), device, args.name, command_args, timeout=args.timeout
            )
        except AgentError as exc:  # no reply from one device must not hide the others' replies
            replies[device] = {"ok": False, "error": str(exc)}
            ok = False
            continue
        replies[device] = reply.model_dump(mode="json", exclude_none=True)
        ok = ok and reply.ok
    print(json.dumps(replies, indent=2))
    return 0 if ok else 1
