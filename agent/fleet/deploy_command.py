"""``edge-agent fleet deploy``: flags in, a deploy run, its outcome printed and turned into an exit code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from agent.camera.preprocess_spec import PreprocessSpec
from agent.delivery.guard import ProbationSpec, ShadowSpec
from agent.delivery.manifest import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from agent.engines.spec import BuildSpec
from agent.errors import UsageError
from agent.fleet.connection import settings_from_args
from agent.fleet.untrusted import shown
from agent.postprocess.spec import ClassificationSpec, DetectionSpec, PostprocessSpec

if TYPE_CHECKING:
    from agent.fleet.deploy_outcome import DeployOutcome, DeviceProgress

from agent.fleet.cli_args import chosen_targets, json_arg, spec_arg, validation_problems

#: Exit codes of ``fleet deploy`` (docs/fleet.md): every device ACTIVE; a device ended in a failure
#: state; some device unfinished at --timeout; a device sent a message that did not parse (and none
#: failed); a device was unknown (no retained status, no --wait-unknown). A failure outranks a
#: malformed message, which outranks an unknown device, which outranks unfinished: a device whose
#: end state did not parse is also unfinished, and the malformed message is what the operator must
#: see; a misspelt id is news, the others' timeout follows from it.
EXIT_OK, EXIT_FAILED, EXIT_UNFINISHED, EXIT_MALFORMED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
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


def run_deploy(args: argparse.Namespace) -> int:
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
            preprocess = PreprocessSpec.model_validate(json_arg(args.preprocess_json, "--preprocess-json"))
        except ValidationError as exc:
            raise UsageError(
                "invalid --preprocess-json", validation_problems(exc, "--preprocess-json")
            ) from exc
    shadow = shadow_from_args(args.shadow_json, no_shadow=args.no_shadow)
    probation = spec_arg(ProbationSpec, args.probation_json, "--probation-json")
    probation_s = probation_s_from_arg(args.probation_s)
    targets = chosen_targets(args, args.device)
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
