"""Rollout store benchmark, as JSON: what the controller's crash-safe state costs per device.

A rollout over N devices (default 1,000) in waves ``5,10%,50%,100%`` is created, then every device
takes the three transitions a deploy writes (``SENDING`` before the publish, ``SENT``, ``ENDED``),
each one SQLite transaction in WAL mode with ``synchronous=FULL`` (an fsync per transition), and
``resume`` (what a restarted controller reads) is timed on a half-done wave, and the reopening of
the file (``PRAGMA quick_check`` of every page, the WAL truncated) at the end. ``wal_peak_bytes``
is the largest the WAL file grew (read after every transition): the disk headroom the store needs
beyond its file. No broker, no device: this measures the store alone, to set against the time
budget of a 1,000-device rollout.

    .venv/bin/python bench/rollout_store.py [--devices 1000] [--dir DIR]

``--dir`` puts the file on a given filesystem (the fsync cost is the disk's); default a temp dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import RolloutPlan, WaveState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.rollout.waves import parse_waves, split_waves


def run(devices: int, directory: Path) -> dict[str, object]:
    """Create, drive and resume one rollout over ``devices`` devices; return the figures."""
    path = directory / "rollouts.sqlite"
    wal = directory / "rollouts.sqlite-wal"
    store = RolloutStore(path)
    names = [f"jet-{index:05d}" for index in range(devices)]
    waves = split_waves(names, parse_waves("5,10%,50%,100%"))
    started = time.perf_counter()
    store.create(RolloutPlan("r1", "main", "job-r1", "5", waves, from_versions=dict.fromkeys(names, "4")))
    create_s = time.perf_counter() - started
    per_transition: list[float] = []
    resume_s = 0.0
    wal_peak = 0
    drive_started = time.perf_counter()
    for index, wave in enumerate(waves):
        store.set_wave("r1", index, WaveState.RUNNING)
        for position, device in enumerate(wave):
            for step in (store.mark_sending, store.mark_sent):
                begin = time.perf_counter()
                step("r1", device)
                per_transition.append(time.perf_counter() - begin)
                wal_peak = max(wal_peak, wal.stat().st_size)
            if index == len(waves) - 1 and position == len(wave) // 2:
                begin = time.perf_counter()
                store.resume("r1")
                resume_s = time.perf_counter() - begin
        for device in wave:
            begin = time.perf_counter()
            store.record_job("r1", device, DeviceEnd.ACTIVE, {"shadow": {"frames": 50, "agreement": 0.97}})
            per_transition.append(time.perf_counter() - begin)
            wal_peak = max(wal_peak, wal.stat().st_size)
        store.set_wave("r1", index, WaveState.DONE, figures={"failed": 0})
    drive_s = time.perf_counter() - drive_started
    store.close()
    size = sum(file.stat().st_size for file in directory.glob("rollouts.sqlite*"))
    begin = time.perf_counter()
    RolloutStore(path).close()
    open_s = time.perf_counter() - begin
    per_transition.sort()
    return {
        "devices": devices,
        "waves": [len(wave) for wave in waves],
        "create_s": round(create_s, 4),
        "drive_s": round(drive_s, 3),
        "transitions": len(per_transition),
        "transition_ms_p50": round(statistics.median(per_transition) * 1000, 3),
        "transition_ms_p99": round(per_transition[int(len(per_transition) * 0.99)] * 1000, 3),
        "resume_ms": round(resume_s * 1000, 3),
        "file_bytes": size,
        "wal_peak_bytes": wal_peak,
        "open_ms": round(open_s * 1000, 3),
    }


def main() -> None:
    """Parse the flags, run, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run(args.devices, args.dir), indent=2))
        return
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(run(args.devices, Path(directory)), indent=2))


if __name__ == "__main__":
    main()
