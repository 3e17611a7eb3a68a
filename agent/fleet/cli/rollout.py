"""``edge-agent fleet controller`` and ``edge-agent fleet rollout start|status|list|pause|resume|abort``.

The rollout commands are clients of the controller (:mod:`agent.fleet.controller.client`): they
resolve the targets here (``--select``, shown before anything is sent, ``--dry-run`` stops there),
upload the model when the controller lacks it, and print what the controller answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agent.errors import UsageError
from agent.fleet.cli.args import FleetRead, add_target_arguments, chosen_targets, keep_slot_model_id
from agent.fleet.cli.connection import add_broker_arguments, settings_from_args
from agent.fleet.cli.deploy import add_manifest_arguments, check_int8_source, manifest_fields
from agent.fleet.rollout.spec import DEFAULT_WAVE_TIMEOUT_S
from agent.fleet.rollout.waves import parse_duration, parse_max_failed, parse_waves

#: Exit codes of ``fleet rollout start --wait`` and ``status --watch``: done; aborted or superseded.
EXIT_DONE, EXIT_ABORTED = 0, 1
_FINAL = ("DONE", "ABORTED", "SUPERSEDED")


#: What ``fleet controller --help`` says the process serves (docs/fleet.md, "The controller").
CONTROLLER_DESCRIPTION = (
    "Run the fleet controller until SIGTERM. It serves: the rollout API the `fleet rollout` commands "
    "use (MQTT requests on {prefix}/_controller/req/{verb}); the model chunks devices pull during "
    "a rollout (no `fleet serve` needed beside it); and, when the config's http.port is set, the "
    "console and Prometheus /metrics over HTTP. Rollout state lives in {state_dir}/rollouts.sqlite."
)


def add_controller_arguments(sub: Any) -> None:
    """``fleet controller`` and ``fleet rollout ...`` sub-parsers."""
    controller = sub.add_parser(
        "controller",
        help="run the fleet controller (rollouts, chunks, console) until SIGTERM",
        description=CONTROLLER_DESCRIPTION,
    )
    controller.add_argument(
        "-c",
        "--config",
        type=Path,
        required=True,
        help="controller YAML (configs/controller.yaml); its mqtt: section reaches the broker",
    )
    controller.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")

    rollout = sub.add_parser("rollout", help="rollouts in waves, run by the fleet controller")
    verbs = rollout.add_subparsers(dest="rollout_command", required=True, metavar="VERB")

    start = verbs.add_parser(
        "start",
        help="start a rollout of MODEL (or of an overlay, an agent release) to the selected devices",
    )
    start.add_argument(
        "model",
        type=Path,
        nargs="?",
        default=None,
        metavar="MODEL.onnx",
        help="the ONNX model file to roll out",
    )
    start.add_argument(
        "--overlay",
        type=Path,
        default=None,
        metavar="OVERLAY.yaml",
        help="roll out this configuration overlay (target _config, needs --version) instead of a model",
    )
    start.add_argument(
        "--agent-release",
        type=Path,
        default=None,
        metavar="DIR",
        help="roll out this agent release (target _agent: a directory `fleet agent release` made) instead",
    )
    add_target_arguments(start)
    add_manifest_arguments(start, targets=True)
    start.add_argument(
        "--release",
        type=Path,
        default=None,
        metavar="FILE",
        help="the model's release from `fleet trust release`, for devices with a fleet root (the "
        "controller's signing key must then be the root's controller key)",
    )
    start.add_argument(
        "--waves",
        default="100%",
        help="where each wave ends, cumulative: e.g. 5,10%%,50%%,100%% (default 100%%)",
    )
    start.add_argument(
        "--soak",
        default="0",
        metavar="DURATION",
        help="wait this long after a wave ended before the next: 10m, 30s (default: 0, none)",
    )
    start.add_argument(
        "--max-failed",
        default="0",
        metavar="N|P%",
        help="bad devices allowed so far: a count or a percentage (default: 0, the first stops the rollout)",
    )
    start.add_argument(
        "--wave-timeout",
        default=f"{DEFAULT_WAVE_TIMEOUT_S / 60:.0f}m",
        metavar="DURATION",
        help="how long a wave may take; then --on-timeout says what happens to the stragglers",
    )
    start.add_argument(
        "--on-timeout",
        choices=("skip", "wait"),
        default="skip",
        help="offline devices at a wave's timeout: skip them (they still get the desired state later) "
        "or wait for them",
    )
    start.add_argument(
        "--rollback-on-abort", action="store_true", help="when the gate trips, move its devices back"
    )
    start.add_argument(
        "--precision-fallback",
        choices=("allow", "fail"),
        default="allow",
        help="a device that runs another precision than --precision asked (an INT8 engine its accuracy "
        "guard refused): fail counts it against --max-failed as unhealthy; allow reports it (default: allow)",
    )
    start.add_argument(
        "--id", dest="rollout_id", default=None, help="rollout id (default: made from the model)"
    )
    start.add_argument(
        "--supersedes", default=None, help="end this running rollout and take over its devices"
    )
    start.add_argument(
        "--share-engines",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="devices take the engine from the controller when one of their platform built it, and offer "
        "theirs (default: the controller's engines.share setting, on; docs/engines.md)",
    )
    start.add_argument("--wait", action="store_true", help="follow the rollout until it ends")
    start.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
    _common(start)

    status = verbs.add_parser("status", help="a rollout's waves and counts (the latest without ID)")
    status.add_argument("rollout_id", nargs="?", default=None, metavar="ID", help="the rollout's id")
    status.add_argument("--json", action="store_true", help="the status document as JSON (docs/fleet.md)")
    status.add_argument("--watch", action="store_true", help="print it again every few seconds until it ends")
    _common(status)

    listing = verbs.add_parser("list", help="the latest rollouts, a line each")
    listing.add_argument("--limit", type=int, default=20, help="show at most this many rollouts")
    listing.add_argument("--json", action="store_true", help="the rollouts' status documents as JSON")
    _common(listing)

    for verb, text in (("pause", "start no new wave"), ("resume", "go on after a pause")):
        parser = verbs.add_parser(verb, help=text)
        parser.add_argument("rollout_id", metavar="ID", help="the rollout's id")
        parser.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
        _common(parser)
    abort = verbs.add_parser("abort", help="stop a rollout: no new device is touched")
    abort.add_argument("rollout_id", metavar="ID", help="the rollout's id")
    abort.add_argument(
        "--rollback", action="store_true", help="and move its devices back to their previous model"
    )
    abort.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
    _common(abort)

    back = verbs.add_parser(
        "rollback",
        help="roll back a finished (DONE) rollout: new rollouts, in waves with the gate, move each of its "
        "devices back to the model it served before",
    )
    back.add_argument("rollout_id", metavar="ID", help="the finished rollout's id")
    back.add_argument(
        "--waves", default=None, help="where each wave ends, cumulative (default: the finished rollout's)"
    )
    back.add_argument(
        "--soak",
        default=None,
        metavar="DURATION",
        help="wait after each wave (default: the finished rollout's)",
    )
    back.add_argument(
        "--max-failed",
        default=None,
        metavar="N|P%",
        help="bad devices allowed so far (default: the finished rollout's)",
    )
    back.add_argument(
        "--wave-timeout",
        default=None,
        metavar="DURATION",
        help="how long a wave may take (default: the finished rollout's)",
    )
    back.add_argument(
        "--on-timeout",
        choices=("skip", "wait"),
        default=None,
        help="offline devices at a wave's timeout (default: the finished rollout's)",
    )
    back.add_argument(
        "--id", dest="new_id", default=None, help="the rollback's rollout id (default: ID-rollback)"
    )
    back.add_argument("--wait", action="store_true", help="follow the rollback until it ends")
    back.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
    _common(back)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the controller's answer"
    )
    add_broker_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (info level)")


def run_controller_command(args: argparse.Namespace) -> int:
    from agent.fleet.cli.serve import install_stop_signals
    from agent.fleet.controller.config import load_controller_config
    from agent.fleet.controller.process import run_controller

    config = load_controller_config(args.config)
    stop = threading.Event()
    install_stop_signals(stop)
    run_controller(config, stop)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    from agent.fleet.controller.client import ControllerClient

    verb = args.rollout_command
    if verb == "start":
        return _start(args)
    if verb == "rollback":
        return _roll_back(args)
    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        if verb == "list":
            result = client.request("list", {"limit": args.limit})
            if args.json:
                print(json.dumps(result["rollouts"], indent=2))
            else:
                from agent.fleet.rollout.report import list_line

                for status in result["rollouts"]:
                    print(list_line(status))
                if not result["rollouts"]:
                    print("no rollouts yet")
            return 0
        if verb == "status":
            return _status(client, args.rollout_id, as_json=args.json, watch=args.watch)
        payload: dict[str, Any] = {"rollout_id": args.rollout_id}
        if verb == "abort":
            payload["rollback"] = args.rollback
        _print_status(client.request(verb, payload), as_json=args.json)
        return 0


def _start(args: argparse.Namespace) -> int:
    from agent.fleet.controller.client import ControllerClient
    from agent.fleet.deploy.model_check import check_model_file
    from agent.fleet.rollout.spec import RolloutRequest
    from agent.fsutil import sha256_file

    chosen = [a for a in (args.model, args.overlay, args.agent_release) if a is not None]
    if len(chosen) != 1:
        raise UsageError(
            "name one thing to roll out: MODEL.onnx, --overlay OVERLAY.yaml or --agent-release DIR"
        )
    if args.model is None:
        return _start_target(args)
    if not args.slot or not args.version:
        raise UsageError("a model rollout needs --slot and --version")
    if not args.model.is_file():
        raise UsageError(f"MODEL.onnx: {args.model} is not a file")
    parse_waves(args.waves)  # each flag's mistake named before anything is read or sent
    parse_max_failed(args.max_failed)
    soak = parse_duration(args.soak, "--soak")
    wave_timeout = parse_duration(args.wave_timeout, "--wave-timeout")
    if not wave_timeout > 0:
        raise UsageError("--wave-timeout must be above 0")
    fields = manifest_fields(args)
    check_model_file(args.model, preprocess=fields["preprocess"], postprocess=fields["postprocess"])
    check_int8_source(fields, args.model)
    # With --json, stdout carries the answer alone: the selection lines go to stderr.
    fleet = FleetRead(args)  # read once, for --select and for the slot's model id alike
    targets = chosen_targets(args, args.device, out=sys.stderr if args.json else None, fleet=fleet)
    if targets is None:
        return 0
    keep_slot_model_id(args, fields, targets.devices, out=sys.stderr if args.json else None, fleet=fleet)
    sha = sha256_file(args.model)
    request = RolloutRequest(
        rollout_id=args.rollout_id,
        model_sha256=sha,
        model_name=args.model.name,
        devices=list(targets.devices),
        waves=args.waves,
        soak_s=soak,
        max_failed=args.max_failed,
        wave_timeout_s=wave_timeout,
        on_timeout=args.on_timeout,
        rollback_on_abort=args.rollback_on_abort,
        precision_fallback=args.precision_fallback,
        supersedes=args.supersedes,
        share_engines=args.share_engines,
        release=args.release.read_text(encoding="utf-8") if args.release is not None else None,
        **fields,
    )
    request.plan("check", "check", 0, {}, {})  # the waves split over this selection, or the error now
    # Unset top-level fields are left out (the controller's defaults are the same), but a null
    # *inside* shadow or probation is the operator's word ("min_agreement": null for a model whose
    # classes changed): dropping it would make the device apply its default bar instead.
    body = {k: v for k, v in request.model_dump(mode="json").items() if v is not None}
    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        if request.calib_sha256 is not None:
            # The calibration goes into the controller's repository like a model (by SHA-256).
            client.upload(args.calib_cache, request.calib_sha256)

        def uploading() -> None:
            print(
                f"rollout: uploading {args.model.name} ({args.model.stat().st_size} bytes) to the controller",
                file=sys.stderr if args.json else sys.stdout,
            )

        status = client.start(body, args.model, on_upload=uploading)
        _print_status(status, as_json=args.json, lines=args.wait)
        if args.wait:
            return _status(client, status["rollout_id"], as_json=args.json, watch=True)
        return 0


#: ``fleet rollout start`` flags that describe a model: a target's rollout refuses them, named.
_MODEL_FLAGS = {
    "slot": "--slot",
    "model_id": "--model-id",
    "precision": "--precision",
    "engine_device": "--engine-device",
    "no_gpu_fallback": "--no-gpu-fallback",
    "calib_cache": "--calib-cache",
    "build_json": "--build-json",
    "calibration": "--calibration",
    "calib_frames": "--calib-frames",
    "calib_stream": "--calib-stream",
    "calib_dataset": "--calib-dataset",
    "preprocess_json": "--preprocess-json",
    "postprocess_json": "--postprocess-json",
    "labels": "--labels",
    "shadow_json": "--shadow-json",
    "no_shadow": "--no-shadow",
    "share_engines": "--share-engines",
    "rollback_on_abort": "--rollback-on-abort",
}


def _start_target(args: argparse.Namespace) -> int:
    from agent.fleet.deploy.target_document import TargetDocument

    given = [flag for dest, flag in _MODEL_FLAGS.items() if getattr(args, dest, None) not in (None, False)]
    if given:
        raise UsageError(
            f"{', '.join(given)}: a model's flags; --overlay and --agent-release roll out a device target "
            "(each device puts back its own last good one: there is no --rollback-on-abort)"
        )

    if args.overlay is not None:
        if not args.version:
            raise UsageError("--overlay needs --version: the overlay's version, what devices report running")
        document = TargetDocument.overlay_file(args.overlay, args.version)
    else:
        document = TargetDocument.agent_release_dir(args.agent_release, args.version)
    fleet = FleetRead(args)
    targets = chosen_targets(args, args.device, out=sys.stderr if args.json else None, fleet=fleet)
    if targets is None:
        return 0
    return start_target(args, document, list(targets.devices))


def start_target(args: argparse.Namespace, document: Any, devices: list[str]) -> int:
    """Start the rollout of a device target's ``document`` (a :class:`~agent.fleet.cli.target.TargetDocument`)
    to ``devices`` with the rollout flags of ``args``; its document and wheels uploaded as the
    controller asks. The exit code (``--wait``: how the rollout ended)."""
    from agent.fleet.controller.client import ControllerClient
    from agent.fleet.deploy.plan import DEFAULT_PROBATION_S
    from agent.fleet.rollout.spec import RolloutRequest

    parse_waves(args.waves)
    parse_max_failed(args.max_failed)
    wave_timeout = parse_duration(args.wave_timeout, "--wave-timeout")
    if not wave_timeout > 0:
        raise UsageError("--wave-timeout must be above 0")
    release = args.release.read_text(encoding="utf-8") if args.release is not None else document.release
    request = RolloutRequest(
        rollout_id=args.rollout_id,
        devices=devices,
        waves=args.waves,
        soak_s=parse_duration(args.soak, "--soak"),
        max_failed=args.max_failed,
        wave_timeout_s=wave_timeout,
        on_timeout=args.on_timeout,
        supersedes=args.supersedes,
        release=release,
        # --probation-s's default is a model's: a target left at it gets its own watch window.
        probation_s=document.probation_s
        if args.probation_s == DEFAULT_PROBATION_S
        else args.probation_s or None,
        **document.request_fields(),
    )
    request.plan("check", "check", 0, {}, {})  # the waves split over this selection, or the error now
    body = {k: v for k, v in request.model_dump(mode="json").items() if v is not None}
    out = sys.stderr if args.json else sys.stdout
    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        for name, path, sha in document.wheels:
            print(f"rollout: {name} to the controller (sent only if it lacks it)", file=out)
            client.upload(path, sha)
        status = client.start(
            body, document.path, on_upload=lambda: print("rollout: uploading the document", file=out)
        )
        _print_status(status, as_json=args.json, lines=args.wait)
        if args.wait:
            return _status(client, status["rollout_id"], as_json=args.json, watch=True)
        return 0


def _roll_back(args: argparse.Namespace) -> int:
    from agent.fleet.controller.client import ControllerClient

    body: dict[str, Any] = {"rollout_id": args.rollout_id}
    if args.waves is not None:
        parse_waves(args.waves)  # each flag's mistake named before anything is sent
        body["waves"] = args.waves
    if args.soak is not None:
        body["soak_s"] = parse_duration(args.soak, "--soak")
    if args.max_failed is not None:
        parse_max_failed(args.max_failed)
        body["max_failed"] = args.max_failed
    if args.wave_timeout is not None:
        body["wave_timeout_s"] = parse_duration(args.wave_timeout, "--wave-timeout")
        if not body["wave_timeout_s"] > 0:
            raise UsageError("--wave-timeout must be above 0")
    if args.on_timeout is not None:
        body["on_timeout"] = args.on_timeout
    if args.new_id is not None:
        body["new_id"] = args.new_id
    with ControllerClient(settings_from_args(args), timeout=args.timeout) as client:
        answer = client.request("rollback", body)
        out = sys.stderr if args.json else sys.stdout
        for devices, why in (
            (answer["no_previous"], "had no model in the slot before: nothing to go back to"),
            (
                answer["unknown_previous"],
                "ran a model no rollout of this controller deployed: `fleet cmd DEVICE rollback` puts "
                "back its last-known-good model",
            ),
        ):
            if devices:
                print(f"rollback: {len(devices)} device(s) not moved ({', '.join(devices)}): {why}", file=out)
        if args.json and not args.wait:
            print(json.dumps(answer, indent=2, sort_keys=True))
            return 0
        code = 0
        for status in answer["rollbacks"]:
            _print_status(status, as_json=args.json, lines=args.wait)
        if args.wait:
            for status in answer["rollbacks"]:
                code = max(code, _status(client, status["rollout_id"], as_json=args.json, watch=True))
        return code


def _status(client: Any, rollout_id: str | None, *, as_json: bool, watch: bool) -> int:
    payload = {} if rollout_id is None else {"rollout_id": rollout_id}
    status = client.request("status", payload)
    if not watch:
        _print_status(status, as_json=as_json)
        return 0
    shown = ""
    while True:
        text = json.dumps(_without_clock(status), sort_keys=True)
        if text != shown:
            _print_status(status, as_json=as_json, lines=True)
            shown = text
        if status["state"] in _FINAL:
            return _exit_code(status)
        time.sleep(2.0)
        status = client.request("status", payload)


#: Status fields that change with the clock alone (a build's elapsed seconds, a wait's seconds, the note that
#: quotes them, the document's own time): ``--watch`` prints again only when something else changed.
_CLOCK_FIELDS = frozenset({"elapsed_s", "waited_s", "note", "updated_at"})


def _without_clock(value: Any) -> Any:
    """``value`` with every :data:`_CLOCK_FIELDS` key left out, at any depth."""
    if isinstance(value, dict):
        return {k: _without_clock(v) for k, v in value.items() if k not in _CLOCK_FIELDS}
    if isinstance(value, list):
        return [_without_clock(v) for v in value]
    return value


def _print_status(status: dict[str, Any], *, as_json: bool, lines: bool = False) -> None:
    """The status as text, or as JSON: indented, or (``lines``: ``--watch``, ``--wait``, which print
    it again at each change) one object per line, so the stream parses as JSON Lines."""
    from agent.fleet.rollout.report import status_lines

    if as_json:
        print(json.dumps(status, sort_keys=True) if lines else json.dumps(status, indent=2, sort_keys=True))
    else:
        for line in status_lines(status):
            print(line)
    sys.stdout.flush()


def _exit_code(status: dict[str, Any]) -> int:
    return EXIT_DONE if status["state"] == "DONE" else EXIT_ABORTED
