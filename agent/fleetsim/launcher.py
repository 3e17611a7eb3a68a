"""``python -m agent.fleetsim``: the flags, the worker processes, and their merged report.

The launcher plans the fleet (:func:`agent.fleetsim.plan.plan_fleet`), starts ``--procs`` worker
processes (the same command with ``--worker K``: device *i* runs in worker ``i mod procs``), waits
for SIGTERM/SIGINT or ``--duration``, stops them, and writes ``{state_dir}/report.json``: every
worker's report merged (:func:`read_reports`). Each worker logs (warnings and up) to
``{state_dir}/worker-K.log``.

Why several processes: the GIL (one core per process at most), and paho's loop, which waits on its
sockets with ``select()``: a process may hold no file descriptor above 1024 (FD_SETSIZE), and each
device holds about six (its socket, the loop's wake-up pair, the spool database and its journal
files), so a process runs at most :data:`MAX_DEVICES_PER_PROC` devices.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from agent.delivery.settings import DeliveryConfig
from agent.errors import UsageError
from agent.fleetsim.device import FleetSetup, SlotSetup
from agent.fleetsim.plan import FIGURES, plan_fleet
from agent.fleetsim.worker import REPORT_EVERY_S, TICK_S, SimWorker, report_path
from agent.fsutil import atomic_write_json, sha256_file
from agent.logs.setup import configure_logging
from agent.model_contract.graph import graph_io
from agent.mqtt.settings import MqttSettings
from agent.protocol.device_targets import AgentRelease
from agent.protocol.messages import ModelRef
from agent.signing import load_public_key
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec

#: Devices one process may run: ~6 descriptors each must stay below select()'s 1024 (see above).
MAX_DEVICES_PER_PROC = 140
_DEFAULT_PER_PROC = 125


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent.fleetsim",
        description="Simulated devices built from the agent's own MQTT link, delivery service and "
        "messages, against one broker (see agent/fleetsim/__init__.py: what is real, what is simulated).",
    )
    p.add_argument("--broker", default="127.0.0.1:1883", help="HOST:PORT of the MQTT broker")
    p.add_argument("--prefix", default="fleet/v1", help="topic prefix (default fleet/v1)")
    p.add_argument("--devices", type=int, default=100, help="how many devices (default 100)")
    p.add_argument(
        "--procs", type=int, default=0, help=f"worker processes (default: one per {_DEFAULT_PER_PROC})"
    )
    p.add_argument("--id-prefix", default="sim", help="device ids are PREFIX-0000, PREFIX-0001, ...")
    p.add_argument("--trust", type=Path, required=True, help="public key (PEM) the devices trust")
    p.add_argument("--key-id", default=None, help="the key's id (default: the file name without suffix)")
    p.add_argument("--state-dir", type=Path, required=True, help="one directory per device is made here")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="SLOT=PATH[:MODEL_ID[:VERSION]]",
        help="the model SLOT serves at start (its input size sets the slot's preprocessing)",
    )
    p.add_argument("--slot", action="append", default=[], help="an empty slot (default: main, if no --model)")
    p.add_argument("--input-size", type=int, default=224, help="input size of the empty slots (default 224)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=V1,V2", help="labels, round-robin")
    p.add_argument(
        "--offline", action="append", default=[], metavar="WHO:START-END", help="switched off then"
    )
    p.add_argument(
        "--unhealthy", action="append", default=[], metavar="WHO:FIGURE", help=f"FIGURE: {', '.join(FIGURES)}"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the device draws (default 0)")
    p.add_argument(
        "--build-seconds",
        type=float,
        default=0.0,
        help="a delivered model needs an engine, whose simulated build takes this long (a sleep: the "
        "Jetson's build is absent here); engines are shared through the controller when the manifest "
        "says so (default 0: no engine, the ONNX file as is)",
    )
    p.add_argument(
        "--share-at-start",
        action="store_true",
        help="the slots' models came from a deployment that shared engines: an engine missing at start-up "
        "(after --upgrade-at) is asked of the fleet first, and one built here is offered after its "
        "start-up job's shadow and probation (as the agent does)",
    )
    p.add_argument(
        "--upgrade-at",
        type=float,
        default=None,
        metavar="SECONDS",
        help="devices (re)started this many seconds after start or later run JetPack 6.1 instead of 6.0 "
        "(every engine key changes); restart them with --offline",
    )
    p.add_argument("--telemetry-s", type=float, default=10.0, help="seconds between telemetry messages")
    p.add_argument(
        "--chunk-timeout-s",
        type=float,
        default=None,
        help="the devices' delivery.chunk_timeout_s: a chunk not answered this long is asked again, the "
        f"wait doubling per try (default {DeliveryConfig().chunk_timeout_s:g}, the agent's)",
    )
    p.add_argument(
        "--report-s",
        type=float,
        default=REPORT_EVERY_S,
        help=f"seconds between rewrites of each worker's report (default {REPORT_EVERY_S:g}; at least "
        f"{TICK_S:g}, the control loop's tick)",
    )
    p.add_argument(
        "--agent-release",
        type=Path,
        default=None,
        metavar="DIR",
        help="the agent release every device runs at start and whose wheels it holds (agent-release.json)",
    )
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: on SIGTERM)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    return p


def _broker(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--broker: {text!r} is not HOST:PORT")
    return host, int(port)


def _slot_setups(args: argparse.Namespace) -> dict[str, SlotSetup]:
    post = ClassificationSpec(top_k=5)
    slots: dict[str, SlotSetup] = {}
    for text in args.model:
        slot, sep, rest = text.partition("=")
        if not sep or not slot or not rest:
            raise UsageError(f"--model: {text!r} is not SLOT=PATH[:MODEL_ID[:VERSION]]")
        path_text, _, tail = rest.partition(":")
        model_id, _, version = tail.partition(":")
        path = Path(path_text)
        if not path.is_file():
            raise UsageError(f"--model: {path} is not a file")
        import onnx  # only here: the simulator's other paths need no ONNX parse

        inputs, _outputs = graph_io(onnx.load(str(path), load_external_data=False))
        shape = inputs[0].shape if inputs else ()
        height = shape[2] if len(shape) == 4 and isinstance(shape[2], int) else args.input_size
        width = shape[3] if len(shape) == 4 and isinstance(shape[3], int) else args.input_size
        ref = ModelRef(
            slot=slot, model_id=model_id or path.stem, version=version or "1", sha256=sha256_file(path)
        )
        slots[slot] = SlotSetup(PreprocessSpec(width=width, height=height), post, ref, path.resolve())
    for slot in args.slot or ([] if slots else ["main"]):
        size = args.input_size
        slots.setdefault(slot, SlotSetup(PreprocessSpec(width=size, height=size), post))
    return slots


def fleet_setup(args: argparse.Namespace) -> FleetSetup:
    """The shared setup of every device, from the flags; raises UsageError."""
    host, port = _broker(args.broker)
    if args.build_seconds < 0:
        raise UsageError(f"--build-seconds: {args.build_seconds} is below 0")
    if args.chunk_timeout_s is not None and args.chunk_timeout_s <= 0:
        raise UsageError(f"--chunk-timeout-s: {args.chunk_timeout_s} is not above 0")
    if args.report_s <= 0:
        raise UsageError(f"--report-s: {args.report_s} is not above 0")
    if not args.trust.is_file():
        raise UsageError(f"--trust: {args.trust} is not a file")
    return FleetSetup(
        # Fast reconnects: a simulated device switched back on should not wait a minute's backoff.
        mqtt=MqttSettings(
            host=host, port=port, prefix=args.prefix, reconnect_min_s=0.5, reconnect_max_s=10.0
        ),
        state_dir=args.state_dir,
        trusted={args.key_id or args.trust.stem: load_public_key(args.trust)},
        slots=_slot_setups(args),
        delivery=DeliveryConfig()
        if args.chunk_timeout_s is None
        else DeliveryConfig(chunk_timeout_s=args.chunk_timeout_s),
        build_seconds=args.build_seconds,
        share_at_start=args.share_at_start,
        agent_release=_agent_release(args.agent_release),
    )


def _agent_release(folder: Path | None) -> AgentRelease | None:
    """The release the devices run at start, from ``--agent-release DIR`` (its agent-release.json)."""
    if folder is None:
        return None
    try:
        return AgentRelease.model_validate_json((folder / "agent-release.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--agent-release: {folder} holds no agent release ({exc})") from exc


def _procs(args: argparse.Namespace) -> int:
    procs: int = args.procs or max(1, math.ceil(args.devices / _DEFAULT_PER_PROC))
    if math.ceil(args.devices / procs) > MAX_DEVICES_PER_PROC:
        raise UsageError(
            f"--procs: {args.devices} devices in {procs} processes is more than {MAX_DEVICES_PER_PROC} per "
            f"process (paho's select() takes no descriptor above 1024); use --procs "
            f"{math.ceil(args.devices / MAX_DEVICES_PER_PROC)} or more"
        )
    return procs


def run_worker(args: argparse.Namespace, stop: threading.Event) -> None:
    """The ``--worker K`` process: its devices until ``stop``."""
    procs = _procs(args)
    plans = plan_fleet(
        args.devices,
        id_prefix=args.id_prefix,
        labels=args.label,
        offline=args.offline,
        unhealthy=args.unhealthy,
        seed=args.seed,
    )
    mine = [p for p in plans if p.index % procs == args.worker]
    setup = fleet_setup(args)
    worker = SimWorker(
        mine,
        setup,
        worker=args.worker,
        t0=args.t0 or time.time(),
        telemetry_s=args.telemetry_s,
        upgrade_at_s=args.upgrade_at,
        report_s=args.report_s,
    )
    worker.run(stop)


def read_reports(state_dir: Path) -> dict[str, Any]:
    """Every worker's report merged: ``devices`` of all, ``workers`` (pid, CPU, RSS, fds) of each."""
    devices: dict[str, Any] = {}
    workers = []
    for path in sorted(state_dir.glob("report-*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: the next read has it
        devices.update(report.pop("devices"))
        workers.append(report)
    return {"devices": dict(sorted(devices.items())), "workers": workers}


def run_fleet(argv: Sequence[str], args: argparse.Namespace, stop: threading.Event) -> dict[str, Any]:
    """Start the workers, wait for ``stop`` (or ``--duration``), stop them; the merged report."""
    procs = _procs(args)
    fleet_setup(args)  # flag errors here, once, rather than in every worker
    plan_fleet(
        args.devices, labels=args.label, offline=args.offline, unhealthy=args.unhealthy, seed=args.seed
    )
    args.state_dir.mkdir(parents=True, exist_ok=True)
    for old in args.state_dir.glob("report-*.json"):
        old.unlink()
    t0 = time.time()
    children = []
    for k in range(procs):
        log_file = (args.state_dir / f"worker-{k}.log").open("ab")
        command = [sys.executable, "-m", "agent.fleetsim", *argv, "--worker", str(k), "--t0", repr(t0)]
        children.append(subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT))
        log_file.close()
    deadline = t0 + args.duration if args.duration > 0 else None
    while not stop.wait(0.5):
        if deadline is not None and time.time() >= deadline:
            break
        if any(child.poll() is not None for child in children):
            break  # a worker died: stop the rest rather than simulate part of the fleet
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    codes = []
    for child in children:
        try:
            codes.append(child.wait(timeout=30))
        except subprocess.TimeoutExpired:
            child.kill()
            codes.append(child.wait())
    merged = read_reports(args.state_dir)
    merged["exit_codes"] = codes
    atomic_write_json(args.state_dir / "report.json", merged)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Cached loggers: 125 agents in one process would queue on the logging module's global lock.
    configure_logging("console", "warning", stream=sys.stderr, cache_loggers=True)
    try:
        if args.worker is not None:
            run_worker(args, stop)
            return 0
        merged = run_fleet(argv, args, stop)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    devices = merged["devices"]
    summary = {
        "devices": len(devices),
        "online": sum(d["online"] for d in devices.values()),
        "workers": [{k: w[k] for k in ("worker", "cpu_s", "peak_rss_mb", "fds")} for w in merged["workers"]],
        "report": str(report_path(args.state_dir, 0).with_name("report.json")),
        "exit_codes": merged["exit_codes"],
    }
    print(json.dumps(summary))
    return 0 if all(code == 0 for code in merged["exit_codes"]) else 1
