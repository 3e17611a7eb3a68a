"""``edge-agent import FILE``: an offline bundle checked and handed to this device's agent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``edge-agent import``."""
    parser.add_argument(
        "file", type=Path, metavar="FILE", help="the bundle (`edge-agent fleet bundle`'s file)"
    )
    parser.add_argument(
        "-c", "--config", type=Path, required=True, help="agent YAML config (the agent's own)"
    )
    parser.add_argument("--json", action="store_true", help="print what was imported as JSON")


def run_import(args: argparse.Namespace) -> int:
    """Check the bundle, copy its files into the stores, hand its desired states to the agent."""
    from agent.config import load_config
    from agent.lifecycle.bundle.importer import import_bundle

    config = load_config(args.config, require_models=False)
    report = import_bundle(args.file, config)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    for target in report.targets:
        print(f"{target.target}: job {target.job_id} (version {target.version}) handed to the agent")
    print(
        f"files: {report.copied} copied ({report.copied_bytes} bytes), {report.present} already present"
        + (f"; fleet root version {report.root_version}" if report.root_version is not None else "")
    )
    if report.signalled is not None:
        print(f"the running agent (pid {report.signalled}) takes them now")
    else:
        print("the agent takes them when it starts")
    return 0
