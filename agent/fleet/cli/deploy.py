"""``edge-agent fleet deploy``: flags in, a deploy run, its outcome printed and turned into an exit code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import TypeAdapter, ValidationError

from agent.errors import UsageError
from agent.flag_aliases import add_alias
from agent.fleet.base.untrusted import shown
from agent.fleet.cli.connection import settings_from_args
from agent.fleet.deploy.plan import DEFAULT_PROBATION_S
from agent.protocol.manifest import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.specs.build import BuildSpec, CalibrationSource
from agent.specs.postprocess import ClassificationSpec, DetectionSpec, PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.fleet.deploy.outcome import DeployOutcome, DeviceProgress

from agent.fleet.cli.args import (
    FleetRead,
    chosen_targets,
    json_arg,
    keep_slot_model_id,
    spec_arg,
    validation_problems,
)

#: Exit codes of ``fleet deploy`` (docs/fleet.md): every device ACTIVE; a device ended in a failure
#: state; some device unfinished at --timeout; a device sent a message that did not parse (and none
#: failed); a device was unknown (no retained status, no --wait-unknown). A failure outranks a
#: malformed message, which outranks an unknown device, which outranks unfinished: a device whose
#: end state did not parse is also unfinished, and the malformed message is what the operator must
#: see; a misspelt id is news, the others' timeout follows from it.
EXIT_OK, EXIT_FAILED, EXIT_UNFINISHED, EXIT_MALFORMED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
#: ``--calib-frames``' bounds and default: the build spec's (``CalibrationSource.frames``).
_FRAMES_FIELD = CalibrationSource.model_fields["frames"]
CALIBRATION_FRAMES_DEFAULT: int = _FRAMES_FIELD.default
MAX_CALIBRATION_FRAMES = 100_000
#: Longest summary line printed per device (its error text is the device's).
_SUMMARY_WIDTH = 300


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
                json_arg(postprocess_json, "--postprocess-json")
            )
        except ValidationError as exc:
            raise UsageError(
                "invalid --postprocess-json", validation_problems(exc, "--postprocess-json")
            ) from exc
    if labels is None:
        return spec
    if spec is None:
        return ClassificationSpec(labels=labels, top_k=min(5, len(labels)))
    if not isinstance(spec, (ClassificationSpec, DetectionSpec)):
        raise UsageError("--labels needs a classification or detection postprocess")
    return spec.model_copy(update={"labels": labels, "labels_file": None})


def calibration_from_args(args: argparse.Namespace, precision: str | None) -> CalibrationSource | None:
    """``build.calibration`` for ``--calibration stream|dataset`` and its ``--calib-*`` flags (pure;
    ``precision``: the build's, from ``--precision`` or ``--build-json``); ``--calib-cache`` is added
    by :func:`manifest_fields` as the manifest's artifact."""
    kind = args.calibration
    if kind is not None and args.calib_cache is not None:
        raise UsageError("--calibration and --calib-cache: give one of them (--calib-cache ships its own)")
    if kind is not None and precision not in ("int8", "best"):
        raise UsageError(f"--calibration {kind} needs an INT8 build: add --precision int8")
    if args.calib_stream is not None and kind != "stream":
        raise UsageError("--calib-stream needs --calibration stream")
    if args.calib_dataset is not None and kind != "dataset":
        raise UsageError("--calib-dataset needs --calibration dataset")
    if args.calib_frames is not None and kind is None:
        raise UsageError("--calib-frames needs --calibration stream or --calibration dataset")
    if kind == "dataset" and args.calib_dataset is None:
        raise UsageError(
            "--calibration dataset needs --calib-dataset DIR: a directory of images on the device"
        )
    if kind is None:
        return None
    values: dict[str, Any] = {"kind": kind}
    if args.calib_frames is not None:
        if not 1 <= args.calib_frames <= MAX_CALIBRATION_FRAMES:
            raise UsageError(f"--calib-frames must be 1 to {MAX_CALIBRATION_FRAMES}")
        values["frames"] = args.calib_frames
    if args.calib_stream is not None:
        values["stream"] = args.calib_stream
    if args.calib_dataset is not None:
        values["path"] = args.calib_dataset
    return CalibrationSource.model_validate(values)


def build_spec_from_args(args: argparse.Namespace) -> BuildSpec | None:
    """A BuildSpec when any build flag is given; None runs the ONNX model as it is.

    ``--build-json`` carries any field of the protocol's BuildSpec; the named flags add theirs, and
    a field given both ways is refused rather than one silently winning.
    """
    given: dict[str, Any] = {}
    if args.build_json is not None:
        raw = json_arg(args.build_json, "--build-json")
        if not isinstance(raw, dict):
            raise UsageError(
                "--build-json must be a JSON object: the build request (BuildSpec, docs/protocol.md)"
            )
        given = raw
    flags: dict[str, tuple[str, Any]] = {}  # field -> (the flag that set it, its value)
    if args.precision is not None:
        flags["precision"] = ("--precision", args.precision)
    if args.engine_device is not None:
        flags["device"] = ("--engine-device", args.engine_device)
    if args.no_gpu_fallback:
        flags["gpu_fallback"] = ("--no-gpu-fallback", False)
    calibration = calibration_from_args(args, args.precision or given.get("precision"))
    if calibration is not None:
        flags["calibration"] = ("--calibration", calibration)
    for field, (flag, _) in flags.items():
        if field in given:
            raise UsageError(f"{flag} and --build-json's {field!r} set the same field: give one of them")
    if not given and not flags:
        return None
    try:
        return BuildSpec.model_validate({**given, **{field: value for field, (_, value) in flags.items()}})
    except ValidationError as exc:
        raise UsageError("invalid --build-json", validation_problems(exc, "--build-json")) from exc


def check_int8_source(fields: dict[str, Any], model: Path) -> None:
    """An INT8 build with no source of scales fails on every device (``build_failed``): refused here,
    before anything is sent, naming the flags that give one. A Q/DQ model carries its own scales."""
    build: BuildSpec | None = fields["build"]
    if build is None or build.precision != "int8" or build.calibration is not None:
        return
    if fields["calib_sha256"] is not None:
        return
    from agent.model_contract.model_facts import model_facts

    if model_facts(model)[1]:
        return
    raise UsageError(
        "--precision int8 needs a calibration source, and none is given (a device builds what the "
        "manifest asks, never its config's calibration): add --calibration stream (each device "
        f"calibrates on its own frames; --calib-frames N, default {CALIBRATION_FRAMES_DEFAULT}), "
        "--calibration dataset --calib-dataset DIR (images on the device), or --calib-cache FILE "
        "(one calibration shipped with the model); or deploy a quantized (Q/DQ) model, or choose "
        "--precision best"
    )


def shadow_from_args(shadow_json: str | None, *, no_shadow: bool) -> ShadowSpec | None:
    """The manifest's ``shadow`` (pure but for reading an @file): on by default, as for a fleet rollout.

    Like the 60 s probation, the default lives in the operator tool: a manifest without ``shadow``
    keeps meaning "no shadow" for older manifests and agents, and ``--no-shadow`` leaves it out.
    """
    if no_shadow:
        if shadow_json is not None:
            raise UsageError("--no-shadow and --shadow-json: give one of them")
        return None
    return spec_arg(ShadowSpec, shadow_json, "--shadow-json") or ShadowSpec()


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


def add_manifest_arguments(parser: argparse.ArgumentParser, *, targets: bool = False) -> None:
    """What the desired state says besides the model file: ``fleet deploy`` and ``fleet rollout start``
    (``targets``: it may roll out a device target instead, which has no slot)."""
    parser.add_argument(
        "--slot",
        required=not targets,
        help="model slot on the devices" + (" (a model only)" if targets else ""),
    )
    parser.add_argument(
        "--version",
        required=not targets,
        help="model version reported with results"
        + ("; a configuration overlay's version" if targets else ""),
    )
    parser.add_argument(
        "--model-id",
        default=None,
        help="model name (default: the one the slot serves now on the targets; the file's stem for an "
        "empty slot)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "int8", "best"),
        default=None,
        help="engine precision; any of the engine flags asks for an engine build",
    )
    engine_device = parser.add_argument(
        "--engine-device",
        choices=("auto", "gpu", "dla0", "dla1", "cpu"),
        default=None,
        help="where the engine runs (TensorRT devices); with --precision this asks for an engine build",
    )
    add_alias(parser, "--device-target", engine_device)  # its name before docs/cli.md's one scheme
    parser.add_argument("--no-gpu-fallback", action="store_true", help="DLA only: no GPU fallback layers")
    parser.add_argument(
        "--calib-cache",
        type=Path,
        default=None,
        metavar="FILE",
        help="INT8 calibration (a calibration table or TensorRT calibration cache) shipped signed with the "
        "model: every device quantizes with it instead of calibrating on its own frames (needs --precision "
        "int8)",
    )
    parser.add_argument(
        "--build-json",
        default=None,
        help="the engine build request: BuildSpec JSON (or @file), any of its fields (workspace_mb, "
        "devices, profiles, optimization_level, slim, fallback ...); the flags above and below add theirs",
    )
    parser.add_argument(
        "--calibration",
        choices=("stream", "dataset"),
        default=None,
        help="INT8 calibration on the device: on its own stream's frames (stream) or on a directory of "
        "images there (dataset, --calib-dataset); needs --precision int8",
    )
    parser.add_argument(
        "--calib-frames",
        type=int,
        default=None,
        metavar="N",
        help=f"--calibration: frames to calibrate on (default {CALIBRATION_FRAMES_DEFAULT})",
    )
    parser.add_argument(
        "--calib-stream",
        default=None,
        metavar="NAME",
        help="--calibration stream: the stream whose frames calibrate (default: the slot's)",
    )
    parser.add_argument(
        "--calib-dataset",
        type=Path,
        default=None,
        metavar="DIR",
        help="--calibration dataset: a directory of images on the device",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help=f"bytes per chunk (default {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument("--preprocess-json", default=None, help="PreprocessSpec JSON (or @file)")
    parser.add_argument("--postprocess-json", default=None, help="PostprocessSpec JSON (or @file)")
    parser.add_argument("--labels", type=Path, default=None, help="class names, one per line")
    parser.add_argument(
        "--shadow-json",
        default=None,
        help="shadow comparison before the swap: ShadowSpec JSON (or @file); default: the ShadowSpec "
        "defaults (30 frames, agreement >= 0.9, latency <= 2x)",
    )
    parser.add_argument(
        "--no-shadow",
        action="store_true",
        help="no shadow comparison (for a model whose classes changed, rather --shadow-json "
        "'{\"min_agreement\": null}')",
    )
    parser.add_argument(
        "--probation-s",
        type=float,
        default=DEFAULT_PROBATION_S,
        help=f"seconds of probation after the swap (default {DEFAULT_PROBATION_S:g}; 0: none, and the "
        "manifest leaves the field out, as older agents need)",
    )
    parser.add_argument(
        "--probation-json", default=None, help="probation health bars: ProbationSpec JSON (or @file)"
    )


def manifest_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The desired state's fields from :func:`add_manifest_arguments`' flags (UsageError naming the flag)."""
    if not MIN_CHUNK_SIZE <= args.chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"--chunk-size must be between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes")
    preprocess = None
    if args.preprocess_json is not None:
        try:
            preprocess = PreprocessSpec.model_validate(json_arg(args.preprocess_json, "--preprocess-json"))
        except ValidationError as exc:
            raise UsageError(
                "invalid --preprocess-json", validation_problems(exc, "--preprocess-json")
            ) from exc
    build = build_spec_from_args(args)  # the calibration flags' mistakes before the cache file's
    calib_sha256 = None
    if args.calib_cache is not None:
        if build is not None and build.calibration is not None:
            raise UsageError("--calib-cache and --build-json's 'calibration': give one of them")
        if not args.calib_cache.is_file():
            raise UsageError(f"--calib-cache: {args.calib_cache} is not a file")
        if args.precision not in ("int8", "best"):
            raise UsageError("--calib-cache needs an INT8 build: add --precision int8")
        from agent.errors import BuildError
        from agent.fsutil import sha256_file
        from agent.model_contract.calibration_file import read_ranges

        try:
            read_ranges(args.calib_cache)  # a file no device can quantize with is refused here
        except BuildError as exc:
            raise UsageError(f"--calib-cache: {exc}") from exc
        calib_sha256 = sha256_file(args.calib_cache)
    return {
        "calib_sha256": calib_sha256,
        "slot": args.slot,
        "version": args.version,
        "model_id": args.model_id,
        "chunk_size": args.chunk_size,
        "build": build,
        "preprocess": preprocess,
        "postprocess": postprocess_from_args(args.postprocess_json, args.labels),
        "shadow": shadow_from_args(args.shadow_json, no_shadow=args.no_shadow),
        "probation_s": probation_s_from_arg(args.probation_s),
        "probation": spec_arg(ProbationSpec, args.probation_json, "--probation-json"),
    }


def run_deploy(args: argparse.Namespace) -> int:
    """``fleet deploy``: a rollout of one wave, run here in the operator's terminal.

    The same :class:`~agent.fleet.rollout.runner.RolloutRunner` as the controller's rollouts, with a
    store in memory (the deploy lives as long as this command), no gate (``--max-failed 100%``: a
    deploy reports every failure instead of stopping at one) and ``--timeout`` as the wave's timeout.
    """
    from agent.fleet.cli.progress import ProgressView, describe_manifest, format_bytes
    from agent.fleet.deploy.keys import load_signing_key
    from agent.fleet.deploy.model_check import check_model_file
    from agent.fleet.deploy.plan import new_job_id, next_sequence
    from agent.fleet.rollout.runner import RolloutRunner
    from agent.fleet.rollout.spec import RolloutRequest
    from agent.fleet.rollout.store import RolloutStore
    from agent.fsutil import sha256_file

    if not args.model.is_file():
        raise UsageError(f"MODEL.onnx: {args.model} is not a file")
    release = None
    if args.release is not None:
        from agent.fleet.trust.keyring import key_id_of

        if args.key is None:
            raise UsageError("--release needs --key: the controller key that signs the desired state")
        release = args.release.read_text(encoding="utf-8")
        args.key_id = args.key_id or key_id_of(args.key)
    if args.key is not None and not args.key_id:
        raise UsageError("--key needs --key-id: the id the devices' delivery.trusted_keys know the key by")
    if not args.status_poll > 0:
        raise UsageError("--status-poll must be a number of seconds above 0")
    if not args.timeout > 0:
        raise UsageError("--timeout must be a number of seconds above 0")
    fields = manifest_fields(args)
    check_model_file(args.model, preprocess=fields["preprocess"], postprocess=fields["postprocess"])
    check_int8_source(fields, args.model)
    fleet = FleetRead(args)  # read once, for --select and for the slot's model id alike
    targets = chosen_targets(args, args.device, fleet=fleet)
    if targets is None:
        return EXIT_OK
    keep_slot_model_id(args, fields, targets.devices, fleet=fleet)
    settings = settings_from_args(args)
    key = load_signing_key(args.key) if args.key is not None else None
    request = RolloutRequest(
        model_sha256=sha256_file(args.model),
        model_name=args.model.name,
        devices=list(targets.devices),
        waves="100%",
        max_failed="100%",
        wave_timeout_s=args.timeout,
        release=release,
        **fields,
    )
    job_id = new_job_id(request.model_id or args.model.stem, request.version)
    store = RolloutStore(Path(":memory:"))
    store.create(request.plan(job_id, job_id, next_sequence(), {}, {}))
    # With -v the log lines share the terminal: one progress line per change, never redrawn in place.
    view = ProgressView(tty=False if args.verbose else None, probation_s=fields["probation_s"])
    runner = RolloutRunner(
        store,
        job_id,
        settings=settings,
        model_path=lambda sha: args.calib_cache if sha == request.calib_sha256 else args.model,
        signing_key=key,
        key_id=args.key_id,
        http_url=lambda sha: args.http_url if sha == request.model_sha256 else None,
        deploy_options={
            "serve": not args.no_serve,
            "max_rate_bps": args.max_rate,
            "on_change": view.update,
            "status_poll_s": args.status_poll,
            "wait_unknown": args.wait_unknown,
        },
    )
    try:
        over = runner.step()  # the wave starts: the desired state is published
        deploy = runner.last_deploy
        assert deploy is not None
        # The first step may have drawn a progress line already: every line goes through the view.
        view.say(f"deploy: {describe_manifest(deploy.manifest)}")
        if key is not None:
            view.say(f"deploy: signed with key id {args.key_id}")
        else:
            view.say("deploy: UNSIGNED; only devices with delivery.require_signature: false accept it")
        topic = f"{settings.prefix}/{{device}}/down/desired/{request.slot}"
        serving = "; serving the chunks" if deploy.server is not None else "; chunks left to `fleet serve`"
        if args.max_rate and deploy.server is not None:
            serving += f" at most {format_bytes(args.max_rate)}/s"
        devices = deploy.snapshot()
        published = sum(1 for p in devices if not p.skipped)
        if published:
            view.say(f"deploy: published to {published} device(s) on {topic} (retained){serving}")
        else:  # every target unknown: nothing was sent and nothing will be served
            view.say("deploy: nothing published: no target is a known device (below)", sys.stderr)
        _print_unknown(devices, settings.prefix, waiting=args.wait_unknown, say=view.say)
        view.update(deploy.snapshot(), force=True)
        while not over:
            runner.wait(0.2)
            over = runner.step()
            view.update(deploy.snapshot())  # a long phase's clock moves without a new job status
        view.close(deploy.snapshot())
    finally:
        runner.stop()
        store.close()
    return _report_outcome(deploy.outcome(), request.slot)


def _print_unknown(
    devices: list[DeviceProgress], prefix: str, *, waiting: bool, say: Callable[[str, TextIO], None]
) -> None:
    """Say at once which targets have no retained status (never connected, or a misspelt id)."""
    unknown = [shown(p.device, 64) for p in devices if p.unknown]
    if not unknown:
        return
    names = ", ".join(unknown[:20]) + (f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else "")
    where = f"{prefix}/{{device}}/up/status"
    if waiting:
        say(
            f"deploy: unknown device(s) {names}: no retained {where}; waiting for them to connect", sys.stdout
        )
    else:
        say(
            f"deploy: unknown device(s) {names}: no retained {where} (never connected to this broker "
            "under this prefix, or misspelt); not deployed to; --wait-unknown waits for them",
            sys.stderr,
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
