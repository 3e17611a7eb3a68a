"""``edge-agent fleet trust ...``: the fleet root of trust, its offline steps and the one online step.

``init``, ``rotate``, ``revoke``, ``sign``, ``release`` and ``show`` read and write files only (an
operator laptop with the root keys on a stick and no network); ``publish`` sends the root chain to
the devices. docs/trust.md walks through them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent.errors import UsageError
from agent.fleet.cli.connection import add_broker_arguments, settings_from_args

DEFAULT_DIR = Path("trust")
DEFAULT_ROOT_DAYS = 365.0
DEFAULT_RELEASE_DAYS = 365.0


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fleet trust`` sub-commands."""
    sub = parser.add_subparsers(dest="trust_command", required=True, metavar="STEP")

    def with_dir(name: str, help_text: str) -> argparse.ArgumentParser:
        step = sub.add_parser(name, help=help_text)
        step.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"the trust directory (default {DEFAULT_DIR})"
        )
        return step

    def with_expiry(step: argparse.ArgumentParser, days: float, what: str) -> None:
        step.add_argument(
            "--expires-days", type=float, default=days, help=f"days until {what} expires (default {days:g})"
        )

    init = with_dir("init", "make the root, release and controller keys and root version 1 (offline)")
    init.add_argument("--root-keys", type=int, default=3, help="root keys to make (default 3)")
    init.add_argument("--threshold", type=int, default=2, help="root keys a root version needs (default 2)")
    with_expiry(init, DEFAULT_ROOT_DAYS, "the root")

    sign = with_dir("sign", "add one root key's signature to the newest root version (offline)")
    sign.add_argument("--key", type=Path, required=True, help="a root key file (root-N.key)")

    rotate = with_dir(
        "rotate", "make the next root version: a role's keys changed, or only renewed (offline)"
    )
    rotate.add_argument("--role", choices=("root", "release", "controller"), required=True, help="the role")
    rotate.add_argument(
        "--add", type=Path, action="append", default=[], metavar="KEY.pub", help="a key file to add (repeat)"
    )
    rotate.add_argument(
        "--remove", action="append", default=[], metavar="KEY_ID", help="a key id to remove (repeat)"
    )
    rotate.add_argument(
        "--threshold", type=int, default=None, help="the role's new threshold (default: unchanged)"
    )
    with_expiry(rotate, DEFAULT_ROOT_DAYS, "the new root version")

    revoke = with_dir("revoke", "make the next root version without KEY_ID, listed as revoked (offline)")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key id (`fleet trust show` lists them)")
    with_expiry(revoke, DEFAULT_ROOT_DAYS, "the new root version")

    show = with_dir("show", "the newest root version: roles, key ids, thresholds, expiry, signatures")
    show.add_argument("--json", action="store_true", help="machine-readable output")

    release = sub.add_parser(
        "release",
        help="sign a model, a configuration overlay or an agent release with the release key (offline)",
    )
    release.add_argument(
        "model", type=Path, nargs="?", default=None, metavar="MODEL.onnx", help="the ONNX model file"
    )
    release.add_argument(
        "--overlay",
        type=Path,
        default=None,
        metavar="OVERLAY.yaml",
        help="sign this configuration overlay instead",
    )
    release.add_argument(
        "--agent-release",
        type=Path,
        default=None,
        metavar="DIR",
        help="sign this agent release instead (a directory `fleet agent release` made)",
    )
    release.add_argument(
        "--key", type=Path, action="append", required=True, help="a release key file (repeat for a threshold)"
    )
    release.add_argument("--out", type=Path, required=True, help="the release file to write")
    release.add_argument("--model-id", default=None, help="model name, as `fleet deploy --model-id`")
    release.add_argument(
        "--version",
        default=None,
        help="model version, as `fleet deploy --version`; an overlay's, as `fleet config set --version`",
    )
    release.add_argument(
        "--preprocess-json", default=None, help="PreprocessSpec JSON (or @file), as deployed"
    )
    release.add_argument(
        "--postprocess-json", default=None, help="PostprocessSpec JSON (or @file), as deployed"
    )
    release.add_argument("--labels", type=Path, default=None, help="class names, one per line, as deployed")
    release.add_argument(
        "--calib-cache", type=Path, default=None, metavar="FILE", help="INT8 calibration, as deployed"
    )
    with_expiry(release, DEFAULT_RELEASE_DAYS, "the release")

    publish = with_dir("publish", "send every root version to the devices, retained on {prefix}/_trust/root")
    publish.add_argument(
        "--adopt-key",
        type=Path,
        default=None,
        help="a key devices without a root trust (fleet keygen's .key): they adopt the root "
        "(needs --adopt-key-id)",
    )
    publish.add_argument(
        "--adopt-key-id", default=None, help="that key's id in the devices' delivery.trusted_keys"
    )
    add_broker_arguments(publish)


def run_trust(args: argparse.Namespace) -> int:
    """Run one ``fleet trust`` step; 0 on success (UsageError/ConfigError otherwise)."""
    from agent.trust.root import RootRefusedError

    try:
        return _run_step(args)
    except RootRefusedError as exc:  # a root file the step cannot build on, said as a usage error
        raise UsageError(str(exc)) from exc


def _run_step(args: argparse.Namespace) -> int:
    from agent.fleet.trust import versions

    step = args.trust_command
    if step == "init":
        root = versions.init(
            args.dir, root_keys=args.root_keys, threshold=args.threshold, expires_days=args.expires_days
        )
        print(f"root version 1 in {args.dir / 'root'}; keys in {args.dir / 'keys'} (private ones 0600)")
        print("move the root-N.key and release.key files offline; give each device, in agent.yaml:")
        print(
            f"  delivery:\n    trust_root: /etc/edge-agent/{versions.TrustDir(args.dir).version_file(1).name}"
        )
        _show(root.signed.to_dict(), as_json=False)
        return 0
    if step == "sign":
        root = versions.sign(args.dir, args.key)
        print(f"root version {root.signed.version}: {len(root.signatures)} signature(s)")
        return 0
    if step == "rotate":
        root = versions.rotate(
            args.dir,
            role=args.role,
            add=args.add,
            remove=args.remove,
            threshold=args.threshold,
            expires_days=args.expires_days,
        )
        print(f"root version {root.signed.version} written unsigned; sign it with root keys of both versions")
        return 0
    if step == "revoke":
        root = versions.revoke(args.dir, args.key_id, expires_days=args.expires_days)
        print(
            f"root version {root.signed.version} revokes {args.key_id}; sign it, then `fleet trust publish`"
        )
        return 0
    if step == "show":
        _show(versions.TrustDir(args.dir).newest().to_dict(), as_json=args.json)
        return 0
    if step == "release":
        return _release(args)
    if step == "publish":
        from agent.fleet.trust.publish import publish_chain

        adopt = None
        if args.adopt_key is not None:
            from agent.fleet.deploy.keys import load_signing_key

            if not args.adopt_key_id:
                raise UsageError(
                    "--adopt-key needs --adopt-key-id: the id the devices' trusted_keys know it by"
                )
            adopt = (load_signing_key(args.adopt_key), args.adopt_key_id)
        topic, version = publish_chain(settings_from_args(args), args.dir, adopt=adopt)
        print(f"root chain up to version {version} published retained on {topic}")
        return 0
    raise UsageError(f"unknown fleet trust step {step!r}")


def _show(metadata: dict[str, object], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(metadata, indent=2, sort_keys=True))
        return
    from agent.trust.roles import fleet_role

    signed = metadata.get("signed", metadata)
    assert isinstance(signed, dict)
    print(f"root version {signed['version']}, expires {signed['expires']}")
    for role, entry in sorted(signed["roles"].items()):
        print(f"  {fleet_role(role):<10} threshold {entry['threshold']}: {', '.join(entry['keyids'])}")
    revoked = signed.get("x-edge-revoked")
    if revoked:
        print(f"  revoked: {', '.join(revoked)}")


def _release(args: argparse.Namespace) -> int:
    chosen = [a for a in (args.model, args.overlay, args.agent_release) if a is not None]
    if len(chosen) != 1:
        raise UsageError(
            "name one thing to release: MODEL.onnx, --overlay OVERLAY.yaml or --agent-release DIR"
        )
    if args.model is None:
        return _target_release(args)
    if not args.model_id or not args.version:
        raise UsageError("a model release needs --model-id and --version, as deployed")
    return _model_release(args)


def _target_release(args: argparse.Namespace) -> int:
    from agent.fleet.deploy.agent_release import read_release_dir
    from agent.fleet.deploy.manifest import target_manifest
    from agent.fleet.deploy.overlay import read_overlay
    from agent.fleet.trust.releases import sign_release
    from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET

    if args.overlay is not None:
        if not args.version:
            raise UsageError(
                "--overlay needs --version: the overlay's version, as `fleet config set --version`"
            )
        read_overlay(args.overlay)  # an overlay no device takes is refused before it is signed
        manifest = target_manifest(CONFIG_TARGET, args.overlay, version=args.version)
        what = f"configuration {args.version}"
    else:
        release_dir = read_release_dir(args.agent_release)
        if args.version and args.version != release_dir.release.version:
            raise UsageError(f"--version {args.version}: the release is {release_dir.release.version}")
        manifest = target_manifest(
            AGENT_TARGET, release_dir.document, version=release_dir.release.version, wheels=release_dir.wheels
        )
        what = f"agent release {release_dir.release.version} ({len(release_dir.wheels)} wheels)"
    out = sign_release(manifest, args.key, args.out, version=1, expires_days=args.expires_days)
    print(f"release of {what} ({manifest.sha256[:16]}) written to {out}")
    return 0


def _model_release(args: argparse.Namespace) -> int:
    from agent.fleet.cli.args import spec_arg
    from agent.fleet.cli.deploy import postprocess_from_args
    from agent.fleet.deploy.plan import CALIBRATION_ARTIFACT
    from agent.fleet.trust.releases import sign_release
    from agent.protocol.manifest import build_manifest, describe_artifact
    from agent.specs.preprocess import PreprocessSpec

    if not args.model.is_file():
        raise UsageError(f"MODEL.onnx: {args.model} is not a file")
    artifacts = []
    if args.calib_cache is not None:
        artifacts.append(describe_artifact(args.calib_cache, name=CALIBRATION_ARTIFACT, kind="calibration"))
    manifest = build_manifest(
        args.model,
        job_id="release",
        sequence=1,
        slot="release",
        model_id=args.model_id,
        version=args.version,
        preprocess=spec_arg(PreprocessSpec, args.preprocess_json, "--preprocess-json"),
        postprocess=postprocess_from_args(args.postprocess_json, args.labels),
        artifacts=artifacts,
    )
    out = sign_release(manifest, args.key, args.out, version=1, expires_days=args.expires_days)
    print(f"release of {args.model_id} {args.version} ({manifest.sha256[:16]}) written to {out}")
    return 0
