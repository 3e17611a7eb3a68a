"""What idle simulated devices cost: CPU per second of N devices, connected, doing nothing (JSON).

The fleet simulator (``python -m agent.fleetsim``) in one worker process against a private
mosquitto; after the devices are online and settled, the process's CPU time over ``--seconds``
(psutil), its threads, and its threads' context switches per device and second (each is a
thread that woke up: an idle loop's turn). Idle cost is what a 1,000-device rollout on two cores
pays before any work: each device runs the agent's own link, dispatcher, delivery upkeep and
command threads.

    .venv/bin/python bench/fleetsim_idle.py [--devices 125] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import write_keypair
from agent.fleetsim.launcher import read_reports


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _switches(pid: int) -> int:
    """Context switches of every thread of ``pid`` (from /proc: psutil reads the main thread's only)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    total += int(line.split()[1])
        except OSError:
            continue  # the thread ended
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=125)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=5.0, help="wait after every device is online")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    broker = Broker(root / "broker", [])
    keys = write_keypair(root / "keys", "bench")
    model = write_classifier(root / "cls.onnx", input_size=32, num_classes=10, seed=1)
    paths = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    sim = None
    try:
        broker.start()
        command = [
            sys.executable, "-m", "agent.fleetsim", "--broker", f"{broker.host}:{broker.port}",
            "--prefix", "idle/v1", "--devices", str(args.devices), "--procs", "1",
            "--trust", str(keys.public), "--key-id", keys.key_id, "--state-dir", str(root / "sim"),
            "--model", f"main={model}:cls:1",
        ]  # fmt: skip
        sim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            devices = read_reports(root / "sim")["devices"]
            if len(devices) == args.devices and all(d["online"] for d in devices.values()):
                break
            time.sleep(1.0)
        else:
            raise RuntimeError("the simulated devices did not all come online within 120 s")
        time.sleep(args.settle_s)
        worker = psutil.Process(read_reports(root / "sim")["workers"][0]["pid"])
        before, switches = _cpu_s(worker), _switches(worker.pid)
        time.sleep(args.seconds)
        used = _cpu_s(worker) - before
        switched = _switches(worker.pid) - switches
        print(
            json.dumps(
                {
                    "devices": args.devices,
                    "seconds": args.seconds,
                    "cpu_s_per_s": round(used / args.seconds, 4),
                    "cores_for_1000_devices": round(1000 * used / args.seconds / args.devices, 2),
                    "threads": worker.num_threads(),
                    "wakeups_per_device_s": round(switched / args.seconds / args.devices, 2),
                }
            )
        )
    finally:
        if sim is not None:
            sim.send_signal(signal.SIGTERM)
            sim.wait(60)
        broker.kill()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
