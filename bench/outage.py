"""Broker-outage benchmark: durable-result spool throughput, and the daemon's memory in a long outage.

Part 1, spool rows/s in one run: one transaction (one fsync) per row, the slow way,
against batches of 32 rows in one transaction, as the publisher writes them now.
Part 2, the real daemon (a subprocess) at full frame rate with durable results and a local mosquitto:
the broker is stopped for ``--outage-s`` (default 120), then started again; RSS is read from /proc
every second. Prints one JSON object.

    .venv/bin/python bench/outage.py [--outage-s 120] [--spool-s 5] [--dir /var/lib/edge-agent-bench]
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
from typing import Any

import yaml

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.demo.setup import write_demo_video
from agent.logs.setup import configure_logging
from agent.spool.queue import Spool, SpoolEntry

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = b'{"msg_id":"' + b"0" * 32 + b'","stream":"cam","classes":[{"label":"a","score":0.9}]}' + b" " * 400


def spool_rows_per_s(directory: Path, seconds: float, batch: int) -> float:
    """Rows per second into a fresh spool, ``batch`` rows per transaction, for ``seconds``."""
    path = directory / f"bench-{batch}.sqlite"
    path.unlink(missing_ok=True)
    rows = 0
    with Spool(path) as spool:
        entries = [SpoolEntry("fleet/v1/bench/up/results/cam", PAYLOAD, kind="result")] * batch
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            if batch == 1:
                spool.add(entries[0].topic, entries[0].payload, 1, False, kind="result")
            else:
                spool.add_many(entries)
            rows += batch
        elapsed = time.perf_counter() - start
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return rows / elapsed


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def _spool_rows(path: Path) -> int:
    import sqlite3

    try:
        db = sqlite3.connect(path, timeout=5.0)
        try:
            return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return -1


def daemon_outage(root: Path, outage_s: float, max_rows: int) -> dict[str, Any]:
    """The daemon at full rate with durable results through an outage of ``outage_s`` seconds."""
    broker = Broker(root / "broker")
    broker.start()
    model = write_classifier(root / "cls.onnx", input_size=32, num_classes=4, seed=1)
    video = write_demo_video(root / "cam.avi", frames=60, size=(160, 120), fps=30.0)
    config = {
        "device_id": "bench-outage",
        "state_dir": str(root / "state"),
        "mqtt": {"host": broker.host, "port": broker.port, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
        "slots": {
            "cls": {
                "model": str(model),
                "preprocess": {"width": 32, "height": 32},
                "postprocess": {"type": "classification", "top_k": 2},
            }
        },
        "streams": {
            "cam": {
                "source": {"type": "file", "path": str(video), "loop": True, "realtime": False},
                "slot": "cls",
                "durable_results": True,
            }
        },
        "spool": {"max_rows": max_rows},
        "telemetry": {"interval_s": 1.0},
        "logging": {"format": "json", "level": "info"},
    }
    config_path = root / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = root / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "-c", str(config_path)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    samples: list[tuple[float, float, int]] = []  # (seconds into the outage, RSS MB, spool rows)
    try:
        time.sleep(10.0)  # started and at full rate
        rss_before = _rss_mb(proc.pid)
        broker.stop()
        start = time.monotonic()
        while (t := time.monotonic() - start) < outage_s:
            samples.append(
                (round(t, 1), round(_rss_mb(proc.pid), 1), _spool_rows(root / "state" / "spool.sqlite"))
            )
            time.sleep(1.0)
        broker.start()
        time.sleep(10.0)  # the replay
        rss_after = _rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        broker.kill()
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    closed: dict[str, Any] = next((e for e in events if e.get("event") == "spool.closed"), {})
    return {
        "outage_s": outage_s,
        "rss_mb_before_outage": round(rss_before, 1),
        "rss_mb_max_in_outage": max(s[1] for s in samples),
        "rss_mb_after_replay": round(rss_after, 1),
        "rss_mb_every_10s": [s[1] for s in samples[::10]],
        "spool_rows_max": max(s[2] for s in samples),
        "spool_max_rows": max_rows,
        "spool_rows_every_10s": [s[2] for s in samples[::10]],
        "spool_evicted": closed.get("evicted"),
        "spool_file_mb": round((root / "state" / "spool.sqlite").stat().st_size / 2**20, 1),
        "cap_warnings": sum(1 for e in events if e.get("event") == "spool.cap.reached"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--outage-s", type=float, default=120.0, help="broker down this long")
    parser.add_argument("--spool-s", type=float, default=5.0, help="seconds per spool throughput case")
    parser.add_argument("--max-rows", type=int, default=100_000, help="spool.max_rows of the daemon")
    parser.add_argument("--dir", type=Path, default=None, help="where the spool lives (default: a temp dir)")
    args = parser.parse_args()
    configure_logging("json", "warning")  # stdout is the JSON result
    root = Path(tempfile.mkdtemp(prefix="bench-outage-", dir=args.dir))
    try:
        per_row = spool_rows_per_s(root, args.spool_s, 1)
        batched = spool_rows_per_s(root, args.spool_s, 32)
        out: dict[str, Any] = {
            "spool_rows_per_s": {
                "one_transaction_per_row": round(per_row),
                "batches_of_32": round(batched),
                "speedup": round(batched / per_row, 1),
            },
            "daemon": daemon_outage(root, args.outage_s, args.max_rows),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
