"""``edge-agent fleet bundle``: what the controller publishes for some devices, in one signed file."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent.errors import UsageError
from agent.fleet.cli.connection import add_broker_arguments, settings_from_args
from agent.fleet.controller.config import DEFAULT_STATE_DIR


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``fleet bundle``."""
    parser.add_argument("out", type=Path, metavar="OUT.bundle", help="the bundle file to write")
    parser.add_argument(
        "--device", action="append", required=True, metavar="D", help="a device to carry (repeat for more)"
    )
    parser.add_argument(
        "--key", type=Path, required=True, help="the controller's private key: it signs the bundle's index"
    )
    parser.add_argument(
        "--key-id",
        default=None,
        help="the key's id on the devices (default: its fleet-root key id, as `fleet trust` shows it)",
    )
    parser.add_argument(
        "--from",
        dest="sources",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help=f"where the deployed files are (repeat; default {DEFAULT_STATE_DIR}/models, the controller's)",
    )
    parser.add_argument(
        "--engines",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the controller's engine store (default {DEFAULT_STATE_DIR}/engines): the shared engines "
        "of devices whose desired state shares engines are carried from here",
    )
    parser.add_argument("--json", action="store_true", help="print the bundle's index as JSON")
    add_broker_arguments(parser)


def run_bundle(args: argparse.Namespace) -> int:
    """Read the devices' retained desired states and the root chain, find their files, write the bundle."""
    from agent.fleet.bundle.retained import read_published
    from agent.fleet.bundle.writer import engine_files, find_files, needed_files, shared_engines, write_bundle
    from agent.fleet.deploy.keys import load_signing_key
    from agent.fleet.engines.settings import EngineShareSettings
    from agent.fleet.engines.store import EngineStore
    from agent.fleet.trust.keyring import key_id_of
    from agent.trust.bundle import index_text

    devices = list(dict.fromkeys(args.device))
    if not args.key.is_file():
        raise UsageError(f"--key: {args.key} is not a file")
    key = load_signing_key(args.key)
    key_id = args.key_id or key_id_of(args.key)
    published = read_published(settings_from_args(args), devices)
    sources = args.sources or [DEFAULT_STATE_DIR / "models"]
    files = find_files(needed_files(published), sources)
    store = EngineStore(args.engines or DEFAULT_STATE_DIR / "engines", EngineShareSettings(), create=False)
    engines = shared_engines(published, store)
    files.update(engine_files(engines, store))
    summary = write_bundle(args.out, published, files, key=key, key_id=key_id, engines=engines)
    if args.json:
        print(index_text(summary.index))
        return 0
    index = summary.index
    for device, entries in index.devices.items():
        shared = len(index.engines.get(device, []))
        carried = f" (+{shared} shared engine(s))" if shared else ""
        print(f"{device}: {', '.join(entry.target for entry in entries)}{carried}")
    chain = "with the fleet root chain" if index.root_chain is not None else "no fleet root"
    print(
        f"{summary.path}: {summary.size} bytes, {len(index.blobs)} file(s), {chain}; signed by key {key_id}"
    )
    return 0
